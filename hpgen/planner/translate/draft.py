"""The plan while the planner writes it: typed entries, written out as a document once.

The translator and the derived path build a :class:`DraftPlan` of :class:`DraftEntry`
objects (:class:`~hpgen.core.plan_entries.Layout` per value, one
:class:`~hpgen.core.placement.Placement` per axis); the passes after them (the cross-checks,
the summed reductions, naming classes by file) return new drafts, and ``hpgen plan``
writes :meth:`DraftPlan.document` once at the end. A draft is owned by the pass holding
it: passes build new drafts (:func:`dataclasses.replace`) and never edit one in place.

Unlike :class:`~hpgen.core.plan_entries.Entry` (what a validated plan reads as, every axis
filled in), a draft entry keeps the axes the planner named, so its document is exactly
what the planner wrote. :meth:`DraftPlan.validated` loads it: the gate a pass falls back on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from hpgen.core.plan import PLAN_FORMAT, PLAN_FORMAT_2, Plan, plan_from_dict
from hpgen.core.plan_entries import LAYOUT_KEYS, FunctionRef, Injection, Layout, LocalCount, SummedReduction
from hpgen.core.plan_names import fqn_matches

__all__ = ["DraftEntry", "DraftPlan", "injection"]

_NO_AXES = Layout(())  # a layout naming no axis: replicated on each


@dataclass(frozen=True)
class DraftEntry:
    """One ``param_plan`` entry as the planner writes it; empty fields are left out of its document."""

    in_src: Mapping[str, Layout] = field(default_factory=dict)
    in_dst: Mapping[str, Layout] = field(default_factory=dict)
    out_src: Mapping[str, Layout] = field(default_factory=dict)
    out_dst: Mapping[str, Layout] = field(default_factory=dict)
    out_names: tuple[str, ...] | None = None
    params: Mapping[str, Layout] = field(default_factory=dict)
    deferred_bias_params: tuple[str, ...] = ()
    grad_reduce_params: tuple[str, ...] = ()
    # the axes each of grad_reduce_params sums over, where the plan names them (then for every
    # one of them); empty: each sums over every axis the body is sharded on
    grad_reduce_axes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    divide_attrs: Mapping[str, int] = field(default_factory=dict)
    tp_divide_attrs: tuple[str, ...] = ()
    local_attrs: Mapping[str, LocalCount] = field(default_factory=dict)  # attribute -> its count on each rank
    out_grad_partial: tuple[str, ...] = ()
    in_grad_partial: tuple[str, ...] = ()
    summed_reduction: SummedReduction | None = None

    def document(self) -> dict[str, Any]:
        """The entry as the plan document writes it."""
        entry: dict[str, Any] = {}
        for part in LAYOUT_KEYS:
            values: Mapping[str, Layout] = getattr(self, part)
            if values:
                entry[part] = {name: layout.document() for name, layout in values.items()}
        if self.out_names is not None:
            entry["out_names"] = list(self.out_names)
        if self.params:
            entry["params"] = {name: layout.document() for name, layout in self.params.items()}
        if self.deferred_bias_params:
            entry["deferred_bias_params"] = list(self.deferred_bias_params)
        if self.grad_reduce_axes:
            entry["grad_reduce_params"] = {name: list(self.grad_reduce_axes[name]) for name in self.grad_reduce_params}
        elif self.grad_reduce_params:
            entry["grad_reduce_params"] = list(self.grad_reduce_params)
        if self.divide_attrs:
            entry["divide_attrs"] = dict(self.divide_attrs)
        for part in ("tp_divide_attrs", "out_grad_partial", "in_grad_partial"):
            if getattr(self, part):
                entry[part] = list(getattr(self, part))
        if self.local_attrs:
            entry["local_attrs"] = {name: count.document() for name, count in self.local_attrs.items()}
        if self.summed_reduction is not None:
            summed = self.summed_reduction
            entry["summed_reduction"] = {"branches": list(summed.branches)}
            if summed.shared_input is not None:
                entry["summed_reduction"]["shared_input"] = summed.shared_input
            if summed.paired_input is not None:
                entry["summed_reduction"]["paired_input"] = summed.paired_input
        return entry

    @property
    def is_boundary(self) -> bool:
        """A boundary (it moves a value in or out), not only parameters and sizes: as the plan loads it."""
        return any(getattr(self, part) for part in LAYOUT_KEYS) or self.summed_reduction is not None

    @property
    def output_names(self) -> tuple[str, ...]:
        """Declared outputs in return order: ``out_names``, or the single out key."""
        return self.out_names if self.out_names is not None else tuple(sorted({*self.out_src, *self.out_dst}))

    def output_layouts(self, name: str) -> tuple[Layout, Layout]:
        """(body's layout, caller's layout) of output ``name``; an axis a layout does not name is replicated."""
        return self.out_src.get(name, _NO_AXES), self.out_dst.get(name, _NO_AXES)

    def signature(self) -> str:
        """The entry's document as canonical text: equal entries, equal text."""
        return json.dumps(self.document(), sort_keys=True)

    def sharded_modules(self) -> set[str]:
        """The modules (relative to the key) owning a parameter that is not replicated on every axis."""
        return {
            name.rpartition(".")[0]
            for name, layout in self.params.items()
            if not all(placement.is_replicate for _, placement in layout.placements)
        }


def injection(match: str, target: str, **kwargs: Any) -> Injection:
    """The injection running ``target`` (a dotted path, called with ``kwargs``) as the body of ``match``."""
    arguments = tuple((name, json.dumps(value, sort_keys=True)) for name, value in sorted(kwargs.items()))
    return Injection(match, FunctionRef(target, arguments))


def _injection_document(item: Injection) -> dict[str, Any]:
    def target(value: FunctionRef) -> dict[str, Any]:
        return {"_target_": value.path, **value.kwargs_dict()}

    document: dict[str, Any] = {"match": item.match, "local_compute_fn": target(item.local_compute_fn)}
    if item.inner_wrapper is not None:
        document["inner_wrapper"] = target(item.inner_wrapper)
    return document


@dataclass(frozen=True)
class DraftPlan:
    """A plan being written: its entries by key, the classes named, injections and comments.

    ``comments`` are the document's free-form notes (ignored by the loader, printed by
    ``hpgen plan --explain``); a pass adds to them with :meth:`with_comments`.
    """

    model_class: str
    mesh: tuple[str, ...]
    entries: Mapping[str, DraftEntry]
    boundary_classes: Mapping[str, str] = field(default_factory=dict)
    injections: tuple[Injection, ...] = ()
    comments: Mapping[str, Any] = field(default_factory=dict)

    def document(self) -> dict[str, Any]:
        """The plan document: what ``hpgen plan`` writes (:func:`~hpgen.planner.translate.document.dumps_plan`)."""
        document: dict[str, Any] = {
            "format": self.format(),
            "model_class": self.model_class,
            "mesh_dim_names": list(self.mesh),
            "param_plan": {key: entry.document() for key, entry in self.entries.items()},
        }
        if self.injections:
            document["injections"] = [_injection_document(item) for item in self.injections]
        if self.comments:
            document["comments"] = dict(self.comments)
        if self.boundary_classes:
            document["boundary_classes"] = dict(self.boundary_classes)
        return document

    def format(self) -> str:
        """``hpgen.plan/2`` where an entry cuts a parameter in whole units or blocks or has ``local_attrs`` (heads
        that do not divide), else ``hpgen.plan/1``: a plan needing nothing new is written as before."""
        for entry in self.entries.values():
            if entry.local_attrs or any(
                placement.whole_units for layout in entry.params.values() for _, placement in layout.placements
            ):
                return PLAN_FORMAT_2
        return PLAN_FORMAT

    def entry_for(self, fqn: str) -> tuple[str, DraftEntry] | None:
        """The key and entry whose key matches a concrete module FQN (at most one in a draft that loads), as
        :meth:`hpgen.core.plan_entries.Plan.entry_for` finds it in the loaded plan: the passes ask the draft itself."""
        for key, entry in self.entries.items():
            if fqn_matches(key, fqn):
                return key, entry
        return None

    def validated(self, name: str | None = None) -> Plan:
        """The draft loaded as a plan; raises :class:`~hpgen.core.errors.HpgenError` where it would not load."""
        return plan_from_dict(self.document()) if name is None else plan_from_dict(self.document(), name=name)

    def with_comments(self, **comments: Any) -> DraftPlan:
        """This draft with ``comments`` added to (or replacing) its notes of those names."""
        return replace(self, comments={**self.comments, **comments})

    def replace(self, **changes: Any) -> DraftPlan:
        """This draft with ``changes`` (fields of :class:`DraftPlan`)."""
        return replace(self, **changes)
