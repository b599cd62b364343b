"""Writing the plan document: the boundaries as entries, the layers' grouped into ``*`` keys.

Concrete boundaries fold into one ``*`` key where every match of the key has the same
class and entry, otherwise they are listed per index (one key may not overlap another).
:mod:`hpgen.resolve` says which keys it resolves statically; the others get
``boundary_classes``. The document is loaded once before it is returned: what the planner
writes must load. :func:`dumps_plan` is its text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpgen.plan import PLAN_FORMAT, plan_from_dict
from hpgen.planner.boundary import Boundary
from hpgen.planner.modules import generic
from hpgen.planner.styles import EXPERTS_PARALLEL

if TYPE_CHECKING:
    from hpgen.index import ModuleIndex

__all__ = ["PlanDocument", "dumps_plan"]


def dumps_plan(plan: Mapping[str, Any]) -> str:
    """The plan as deterministic JSON text: sorted keys, two-space indent, final newline."""
    return json.dumps(plan, indent=2, sort_keys=True) + "\n"


class PlanDocument:
    """The document step of a :class:`~hpgen.planner.translator.Translator`."""

    model: Any
    modules: dict[str, Any]
    mesh: tuple[str, ...]
    boundaries: dict[str, Boundary]
    source: Path
    index: ModuleIndex
    name: str

    def _document(self) -> dict[str, Any]:
        groups = self._grouped()
        param_plan = {key: entry for key, (_, entry) in groups.items()}
        injections = [
            {"match": key, "local_compute_fn": {"_target_": EXPERTS_PARALLEL, "axis": boundary.injection_axis}}
            for key, (boundary, _) in sorted(groups.items())
            if boundary.injection_axis is not None
        ]
        document: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "model_class": type(self.model).__name__,
            "mesh_dim_names": list(self.mesh),
            "param_plan": param_plan,
        }
        if injections:
            document["injections"] = injections
        if getattr(self, "corrected", None):  # transformers' styles the source contradicts (corrections.py)
            document["comments"] = {"corrected": dict(sorted(self.corrected.items()))}
        classes = self._boundary_classes(groups)
        if classes:
            document["boundary_classes"] = classes
        plan_from_dict(document, name=f"hpgen plan {self.name}")  # what we write must load
        return document

    def _grouped(self) -> dict[str, tuple[Boundary, dict[str, Any]]]:
        """Concrete boundaries folded into ``*`` keys where every match agrees."""
        by_pattern: dict[str, list[Boundary]] = {}
        for fqn, boundary in sorted(self.boundaries.items()):
            by_pattern.setdefault(generic(fqn), []).append(boundary)
        result: dict[str, tuple[Boundary, dict[str, Any]]] = {}
        for pattern, members in by_pattern.items():
            matches = [fqn for fqn in self.modules if fqn and generic(fqn) == pattern]
            signatures = {
                (type(b.module).__name__, json.dumps(self._entry(b), sort_keys=True), b.injection_axis) for b in members
            }
            if len(members) == len(matches) and len(signatures) == 1:
                result[pattern] = (members[0], self._entry(members[0]))
            else:
                for boundary in members:
                    result[boundary.fqn] = (boundary, self._entry(boundary))
        return result

    def _entry(self, boundary: Boundary) -> dict[str, Any]:
        """The plan entry of one boundary (a derived plan adds what its layouts need)."""
        return boundary.entry()

    def _boundary_classes(self, groups: Mapping[str, tuple[Boundary, dict[str, Any]]]) -> dict[str, str]:
        """``boundary_classes`` for the keys that hpgen's static resolution gets wrong or cannot get."""
        from hpgen.errors import HpgenError as _Error
        from hpgen.resolve import resolve_boundaries

        classes = {}
        for key, (boundary, entry) in groups.items():
            wanted = boundary.wrapped_as or type(boundary.module).__name__
            single = {
                "mesh_dim_names": list(self.mesh),
                "model_class": type(self.model).__name__,
                "param_plan": {key: entry},
            }
            try:
                found = resolve_boundaries(plan_from_dict(single), self.index, source_name=self.source.name)[key]
                ok = found.name.rsplit(".", 1)[-1] == wanted.rsplit(".", 1)[-1] and found.external == bool(
                    boundary.wrapped_as
                )
            except _Error:
                ok = False
            if not ok:
                classes[key] = wanted
        return classes
