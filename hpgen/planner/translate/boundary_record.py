"""The record of one boundary a plan's steps fill in, and the two questions asked of all of them.

A :class:`Boundary` is a concrete module (``model.layers.3.mlp``) with the layouts of its
inputs, outputs and parameters (:class:`~hpgen.core.plan_entries.Layout`, one
:class:`~hpgen.core.placement.Placement` per mesh axis) as the steps fill them in;
:meth:`Boundary.entry` gives its plan entry (a :class:`~hpgen.planner.translate.draft.DraftEntry`).
:func:`add_boundary` adds one to a plan's boundaries (or returns the one there);
:func:`enclosing` finds the nearest at or above a module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpgen.core.errors import HpgenError
from hpgen.core.plan_entries import Layout
from hpgen.planner.translate.draft import DraftEntry

if TYPE_CHECKING:
    from hpgen.planner.translate.plan_context import PlanContext

__all__ = ["Boundary", "Transition", "add_boundary", "enclosing"]

Transition = tuple[Layout, Layout]  # (src, dst): an input's caller -> body, an output's body -> caller


@dataclass
class Boundary:
    """One concrete boundary module and the entry it is getting."""

    fqn: str
    module: Any
    kind: str  # block | experts | linear | embedding | identity | sp, or a derived kind's (attrs for an attrs entry)
    inputs: dict[str, Transition] = field(default_factory=dict)
    outputs: dict[str, Transition] = field(default_factory=dict)
    out_names: tuple[str, ...] | None = None
    params: dict[str, Layout] = field(default_factory=dict)
    deferred: set[str] = field(default_factory=set)
    grad_reduce: set[str] = field(default_factory=set)
    divide_attrs: dict[str, int] = field(default_factory=dict)
    tp_divide_attrs: set[str] = field(default_factory=set)
    local_attrs: dict[str, LocalCount] = field(default_factory=dict)  # attribute -> its count on each rank
    out_grad_partial: tuple[str, ...] = ()
    axes: set[str] = field(default_factory=set)
    injection_axis: str | None = None
    wrapped_as: str | None = None  # "nn.Linear" / "nn.Embedding" for modules parallelize wraps
    sp_input: bool = False  # a block entered from the sequence-sharded residual stream (--sp)

    def entry(self) -> DraftEntry:
        """The ``param_plan`` entry this boundary gets."""
        return DraftEntry(
            in_src={name: src for name, (src, _) in self.inputs.items()},
            in_dst={name: dst for name, (_, dst) in self.inputs.items()},
            out_src={name: src for name, (src, _) in self.outputs.items()},
            out_dst={name: dst for name, (_, dst) in self.outputs.items()},
            out_names=self.out_names,
            params=dict(self.params),
            deferred_bias_params=tuple(sorted(self.deferred)),
            grad_reduce_params=tuple(sorted(self.grad_reduce)),
            divide_attrs=dict(self.divide_attrs),
            tp_divide_attrs=tuple(sorted(self.tp_divide_attrs)),
            local_attrs=dict(sorted(self.local_attrs.items())),
            out_grad_partial=tuple(self.out_grad_partial),
        )


def add_boundary(context: PlanContext, boundaries: dict[str, Boundary], fqn: str, kind: str) -> Boundary:
    """The boundary at ``fqn`` of ``kind``, added to ``boundaries`` if it is not there yet.

    A block that is also an experts module becomes an experts boundary; any other pair of
    kinds at one module is an error.
    """
    found = boundaries.get(fqn)
    if found is None:
        found = boundaries[fqn] = Boundary(fqn, context.modules[fqn], kind)
    elif found.kind != kind and {found.kind, kind} != {"block", "experts"}:
        raise HpgenError(f"{context.name}: {fqn} would be both a {found.kind} and a {kind} boundary")
    elif kind == "experts":
        found.kind = kind
    return found


def enclosing(boundaries: dict[str, Boundary], fqn: str) -> Boundary | None:
    """The nearest boundary at ``fqn`` or above it."""
    path = fqn
    while True:
        if path in boundaries:
            return boundaries[path]
        if not path:
            return None
        path = path.rpartition(".")[0] if "." in path else ""
