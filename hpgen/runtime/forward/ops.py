"""Running the classifier's ops at run time, and finding an output in a return value.

``hpgen.core.transitions.value_ops`` decides, for each declared input and output of a boundary,
which collective runs on which axis (with which backward); generated files spell those
calls out in source. Boundaries that are not generated (the wrapped ``nn.Embedding`` and
``nn.Linear``, the generic form's static values) run the very same ops through
:func:`steps_for`, bound once at install so that a forward costs one method call per op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from hpgen.core.transitions import Op, ValueOps
from hpgen.runtime.forward.collectives import AxisCollectives

__all__ = ["Address", "Step", "address_of", "get_output", "replace_output", "run_steps", "steps_for"]

Step = tuple[Callable[..., Any], dict[str, Any]]
"""One op, bound: the axis method and its keyword arguments."""

Address = tuple[object, ...]
"""Where an output sits in a return value: ``("whole",)``, ``("index", i)`` or ``("attr", name)``."""


def step_for(op: Op, axes: Mapping[str, AxisCollectives]) -> Step:
    """``op`` as a call on its axis: ``getattr(axis, op.kind)(x, **args, backward=...)``."""
    if op.kind == "generic":
        raise ValueError(f"{op.comment()}: has no collective; it needs the DTensor path")
    kwargs: dict[str, Any] = dict(op.args)
    if op.backward is not None:
        kwargs["backward"] = op.backward
    return getattr(axes[op.axis], op.kind), kwargs


def steps_for(value: ValueOps, axes: Mapping[str, AxisCollectives]) -> tuple[Step, ...]:
    """The non-identity ops of one declared value, bound, in the order they run."""
    return tuple(step_for(op, axes) for op in value.ops if not op.is_identity)


def run_steps(x: Any, steps: Sequence[Step]) -> Any:
    """Apply bound ops to ``x`` in order (each collective passes ``None`` through)."""
    for method, kwargs in steps:
        x = method(x, **kwargs)
    return x


def address_of(outputs: Any, output_names: Sequence[str], name: str) -> Address:
    """Where output ``name`` is in ``outputs``, judged from the value actually returned.

    A tuple holds the declared outputs in ``output_names`` order; a record (a
    ``ModelOutput`` or any object with that attribute) holds them by name; anything else
    is the single declared output itself.
    """
    if isinstance(outputs, tuple):
        return ("index", list(output_names).index(name))
    if not isinstance(outputs, Tensor) and hasattr(outputs, name):
        return ("attr", name)
    return ("whole",)


def get_output(outputs: Any, address: Address) -> Any:
    """The value at ``address`` in ``outputs``."""
    if address[0] == "index":
        return outputs[address[1]]
    if address[0] == "attr":
        return getattr(outputs, address[1])
    return outputs


def replace_output(outputs: Any, address: Address, value: Any) -> Any:
    """``outputs`` with the value at ``address`` replaced (tuples are rebuilt, records updated)."""
    if address[0] == "index":
        index = address[1]
        return (*outputs[:index], value, *outputs[index + 1 :])
    if address[0] == "attr":
        setattr(outputs, address[1], value)
        return outputs
    return value
