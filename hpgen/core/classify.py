"""From an entry's operations to its form (docs/plan-format.md, docs/generated-code.md).

``classify_contract`` takes the ops of every declared input and output of a boundary (its
:class:`~hpgen.core.decision.EntryDecision`; the ops themselves come from
:mod:`hpgen.core.transitions`), checks the static gates against the indexed ``forward``, and
picks the form: identity, tp_collective, generic or region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpgen.core.decision import EntryDecision, entry_decision
from hpgen.core.plan import Plan
from hpgen.core.transitions import SummedOps, ValueOps, transition, value_ops

__all__ = ["FORMS", "Contract", "classify_contract", "transition", "undeclared_inputs", "value_ops"]

if TYPE_CHECKING:
    from hpgen.generator.index_records import ForwardInfo

FORMS = ("identity", "tp_collective", "generic", "region")


# --------------------------------------------------------------------------- contracts


@dataclass(frozen=True)
class Contract:
    """A classified boundary contract: ops per value, form, and the reasons behind it."""

    signature: str
    keys: tuple[str, ...]
    inputs: tuple[ValueOps, ...]
    outputs: tuple[ValueOps, ...]
    form: str
    reasons: tuple[str, ...]  # why generic (gates or ops), empty otherwise
    gate_failures: tuple[str, ...]  # the static gates that failed (a subset of reasons)
    region_target: str | None  # dotted path of the local compute function, or "_forward_impl"
    # forward parameters the plan does not declare, reaching a body sharded on ``undeclared_axes``:
    # each gets ``copy_if_grad`` on those axes (R, its gradient all-reduced, when it requires grad)
    undeclared: tuple[str, ...] = ()
    undeclared_kwargs: str | None = None  # the **kwargs parameter, whose undeclared values get the same
    undeclared_axes: tuple[str, ...] = ()
    # undeclared parameters (and ``**kwargs``, so written) the body only hands to child boundaries, which
    # own their gradients: no copy here (a second all-reduce would count the gradient again)
    handed_on: tuple[str, ...] = ()
    summed: SummedOps | None = None  # the one edit inside the body (a parallel-residual block)

    @property
    def axes(self) -> tuple[str, ...]:
        """Mesh axes that some emitted op runs on, in first-use order."""
        seen: list[str] = []
        for value in (*self.inputs, *self.outputs):
            for op in value.active:
                if op.axis not in seen:
                    seen.append(op.axis)
        if self.summed is not None and self.summed.axis not in seen:
            seen.append(self.summed.axis)
        if self.undeclared or self.undeclared_kwargs:
            seen += [axis for axis in self.undeclared_axes if axis not in seen]
        return tuple(seen)

    def collectives_per_call(self) -> dict[str, int]:
        """Forward communication per call of ``forward``, by op kind."""
        counts: dict[str, int] = {}
        ops = [op for value in (*self.inputs, *self.outputs) for op in value.active]
        if self.summed is not None:
            ops.append(self.summed.reduce)
        for op in ops:
            if op.communicates or op.kind == "generic":
                counts[op.kind] = counts.get(op.kind, 0) + 1
        return counts


def classify_contract(
    plan: Plan, keys: tuple[str, ...], forward: ForwardInfo | None, *, owned: frozenset[str] = frozenset()
) -> Contract:
    """Classify the contract shared by the entry ``keys`` against the class's ``forward``.

    ``owned``: the ``forward`` parameters whose gradients child boundaries own (the generator's
    ``owned_by_children``); undeclared, they get no copy.
    """
    decision = entry_decision(plan, keys[0])
    entry, inputs, outputs, signature = decision.entry, decision.inputs, decision.outputs, decision.signature
    region_target = decision.region_target
    if decision.is_identity:
        return Contract(signature, keys, inputs, outputs, "identity", (), (), None)
    reasons = [op.comment() for value in (*inputs, *outputs) for op in value.ops if op.kind == "generic"]
    addressed = []
    gate_failures: list[str] = []
    if forward is not None:
        gate_failures = _gate_failures(forward, inputs, outputs)
        addressed = [ValueOps(v.name, v.ops, _output_address(forward, entry.output_names, v.name)) for v in outputs]
    outputs = tuple(addressed) if addressed else outputs
    reasons += gate_failures
    undeclared, undeclared_kwargs, undeclared_axes, handed_on = undeclared_inputs(decision, forward, owned)
    if region_target is not None:
        form = "region"
    else:
        form = "generic" if reasons else "tp_collective"
    if form == "region" and any(op.kind == "generic" for value in (*inputs, *outputs) for op in value.ops):
        form = "generic"
    return Contract(
        signature,
        keys,
        inputs,
        outputs,
        form,
        tuple(reasons),
        tuple(gate_failures),
        region_target,
        undeclared,
        undeclared_kwargs,
        undeclared_axes,
        handed_on,
        summed=decision.summed,
    )


def undeclared_inputs(
    decision: EntryDecision, forward: ForwardInfo | None, owned: frozenset[str] = frozenset()
) -> tuple[tuple[str, ...], str | None, tuple[str, ...], tuple[str, ...]]:
    """The ``forward`` parameters the entry does not declare and must copy, its ``**kwargs`` name (when
    its values must be copied), the axes its body is sharded on, and the undeclared parameters of ``owned``.

    An undeclared value is ``R`` on every axis (docs/plan-format.md). Entering a body sharded on an
    axis, a tensor (or tuple/list of tensors) that requires grad gets ``copy`` there, as a
    declared ``R`` input would: each rank's backward sees only its shard's part of the
    gradient. Whether it requires grad is known only at run time, so the generated code
    calls ``copy_if_grad``, which passes everything else on untouched. A parameter of ``owned``
    reaches no computation of the body itself: the child boundaries it is handed to give back its
    whole gradient, so it gets no copy (an all-reduce of a whole gradient would multiply it).
    """
    entry, axes = decision.entry, decision.sharded_axes
    if forward is None or not axes:
        return (), None, (), ()
    declared = set(entry.input_names)
    undeclared = [
        parameter.name
        for parameter in forward.parameters[1:]  # self
        if parameter.kind not in ("var_positional", "var_keyword") and parameter.name not in declared
    ]
    kwargs = next((p.name for p in forward.parameters if p.kind == "var_keyword"), None)
    handed_on = tuple(name for name in undeclared if name in owned) + ((f"**{kwargs}",) if kwargs in owned else ())
    names = tuple(name for name in undeclared if name not in owned)
    copied_kwargs = kwargs if kwargs is not None and kwargs not in owned else None
    return names, copied_kwargs, axes, handed_on


def _gate_failures(forward: ForwardInfo, inputs: tuple[ValueOps, ...], outputs: tuple[ValueOps, ...]) -> list[str]:
    """The static gates of the tp_collective form (docs/generated-code.md); each failure is a reason."""
    failures = []
    if forward.has_var_positional:
        failures.append("forward takes *args, so its inputs cannot be passed on by name")
    for value in inputs:
        if value.active and forward.parameter(value.name) is None:
            failures.append(f"input {value.name!r} is not a parameter of forward (it arrives in **kwargs)")
    if any(value.active for value in outputs):
        for shape in forward.returns:
            if shape.kind == "none":
                failures.append(f"the return on line {shape.line} returns no value")
        if forward.falls_off_end:
            failures.append("forward can end without a return")
        kinds = {shape.kind for shape in forward.returns if shape.kind != "none"}
        if len(kinds) > 1:
            lines = ", ".join(f"{shape.kind} on line {shape.line}" for shape in forward.returns)
            failures.append(f"forward returns values of different shapes ({lines})")
        names = [value.name for value in outputs]
        for value in outputs:
            if not value.active:
                continue
            position = names.index(value.name)
            for shape in forward.returns:
                if shape.kind == "tuple" and shape.length is not None and position >= shape.length:
                    failures.append(
                        f"output {value.name!r} is item {position} but the return on line {shape.line} has {shape.length}"
                    )
                if shape.kind == "record" and value.name not in shape.keywords:
                    failures.append(f"output {value.name!r} is not a field of the record returned on line {shape.line}")
    return failures


def _output_address(forward: ForwardInfo, output_names: tuple[str, ...], name: str) -> tuple[object, ...]:
    """Where output ``name`` sits in the return value, from the returns' static shapes."""
    position = output_names.index(name)
    kinds = {shape.kind for shape in forward.returns if shape.kind != "none"}
    if kinds == {"tuple"}:
        return ("index", position)
    if kinds == {"record"} and all(name in shape.keywords for shape in forward.returns if shape.kind == "record"):
        return ("attr", name)
    if len(output_names) == 1:
        return ("whole",)
    return ("index", position)
