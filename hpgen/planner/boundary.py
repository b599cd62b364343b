"""The record of one boundary a plan's steps fill in, and the two questions asked of all of them.

A :class:`Boundary` is a concrete module (``model.layers.3.mlp``) with the layouts of its
inputs, outputs and parameters (:class:`~hpgen.plan_entries.Layout`, one
:class:`~hpgen.placement.Placement` per mesh axis) as the steps fill them in;
:meth:`Boundary.entry` writes its plan entry, the one place the placements become text.
:func:`add_boundary` adds one to a plan's boundaries (or returns the one there);
:func:`enclosing` finds the nearest at or above a module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpgen.errors import HpgenError
from hpgen.plan_entries import Layout

if TYPE_CHECKING:
    from hpgen.planner.plan_context import PlanContext

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
    out_grad_partial: tuple[str, ...] = ()
    axes: set[str] = field(default_factory=set)
    injection_axis: str | None = None
    wrapped_as: str | None = None  # "nn.Linear" / "nn.Embedding" for modules parallelize wraps
    sp_input: bool = False  # a block entered from the sequence-sharded residual stream (--sp)

    def entry(self) -> dict[str, Any]:
        """The ``param_plan`` entry, as the document writes it."""
        entry: dict[str, Any] = {}
        for part, values in (("in", self.inputs), ("out", self.outputs)):
            if values:
                entry[f"{part}_src"] = {name: src.document() for name, (src, _) in values.items()}
                entry[f"{part}_dst"] = {name: dst.document() for name, (_, dst) in values.items()}
        if self.out_names is not None:
            entry["out_names"] = list(self.out_names)
        if self.params:
            entry["params"] = {name: layout.document() for name, layout in self.params.items()}
        if self.deferred:
            entry["deferred_bias_params"] = sorted(self.deferred)
        if self.grad_reduce:
            entry["grad_reduce_params"] = sorted(self.grad_reduce)
        if self.divide_attrs:
            entry["divide_attrs"] = dict(self.divide_attrs)
        if self.tp_divide_attrs:
            entry["tp_divide_attrs"] = sorted(self.tp_divide_attrs)
        if self.out_grad_partial:
            entry["out_grad_partial"] = list(self.out_grad_partial)
        return entry


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
