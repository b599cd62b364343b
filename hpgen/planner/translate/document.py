"""Writing the plan document: the boundaries as entries, the layers' grouped into ``*`` keys.

Concrete boundaries fold into one ``*`` key where every match of the key has the same
class and entry, otherwise they are listed per index (one key may not overlap another).
:mod:`hpgen.generator.resolve` says which keys it resolves statically; the others get
``boundary_classes``. :func:`grouped` folds the boundaries, :func:`plan_draft` makes the
:class:`~hpgen.planner.translate.draft.DraftPlan` and loads it once before it is returned: what the
planner writes must load. :func:`dumps_plan` is the text of its document.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hpgen.core.errors import HpgenError
from hpgen.core.plan_entries import Injection
from hpgen.planner.model.modules import generic
from hpgen.planner.translate.boundary_record import Boundary
from hpgen.planner.translate.draft import DraftEntry, DraftPlan, injection
from hpgen.planner.translate.styles import EXPERTS_PARALLEL

if TYPE_CHECKING:
    from hpgen.planner.translate.plan_context import PlanContext

__all__ = ["Grouped", "boundary_classes", "dumps_plan", "expert_injections", "grouped", "plan_draft"]

Grouped = dict[str, tuple[Boundary, DraftEntry]]  # plan key -> (a boundary it matches, the entry)


def dumps_plan(plan: Mapping[str, Any]) -> str:
    """The plan as deterministic JSON text: sorted keys, two-space indent, final newline."""
    return json.dumps(plan, indent=2, sort_keys=True) + "\n"


def plan_draft(
    context: PlanContext,
    groups: Grouped,
    *,
    injections: Sequence[Injection] = (),
    comments: Mapping[str, Any] | None = None,
) -> DraftPlan:
    """The draft plan of the grouped entries, loaded once before it is returned: what we write must load."""
    draft = DraftPlan(
        model_class=type(context.model).__name__,
        mesh=tuple(context.mesh),
        entries={key: entry for key, (_, entry) in groups.items()},
        boundary_classes=boundary_classes(context, groups),
        injections=tuple(injections),
        comments=dict(comments or {}),
    )
    draft.validated(name=f"hpgen plan {context.name}")
    return draft


def expert_injections(groups: Grouped) -> list[Injection]:
    """The experts that dispatch tokens by expert (``ep_dispatch_experts``): :data:`EXPERTS_PARALLEL` on their axis."""
    return [
        injection(key, EXPERTS_PARALLEL, axis=boundary.injection_axis)
        for key, (boundary, _) in sorted(groups.items())
        if boundary.injection_axis is not None
    ]


def grouped(context: PlanContext, boundaries: Mapping[str, Boundary]) -> Grouped:
    """Concrete boundaries folded into ``*`` keys where every match agrees, with their entries."""
    by_pattern: dict[str, list[Boundary]] = {}
    for fqn, boundary in sorted(boundaries.items()):
        by_pattern.setdefault(generic(fqn), []).append(boundary)
    result: Grouped = {}
    for pattern, members in by_pattern.items():
        matches = [fqn for fqn in context.modules if fqn and generic(fqn) == pattern]
        signatures = {
            (type(b.module).__name__, b.entry().signature(), b.injection_axis) for b in members
        }
        if len(members) == len(matches) and len(signatures) == 1:
            result[pattern] = (members[0], members[0].entry())
        else:
            for boundary in members:
                result[boundary.fqn] = (boundary, boundary.entry())
    return result


def boundary_classes(context: PlanContext, groups: Grouped) -> dict[str, str]:
    """``boundary_classes`` for the keys that hpgen's static resolution gets wrong or cannot get.

    An ``attrs`` entry of a derived plan (only ``tp_divide_attrs``) is no boundary: it has no class to name.
    """
    from hpgen.generator.resolve import resolve_boundaries

    index, source_name = context.forwards.index, context.forwards.source.name
    classes = {}
    for key, (boundary, entry) in groups.items():
        if boundary.kind == "attrs":
            continue
        wanted = boundary.wrapped_as or type(boundary.module).__name__
        single = DraftPlan(type(context.model).__name__, tuple(context.mesh), {key: entry})
        try:
            found = resolve_boundaries(single.validated(), index, source_name=source_name)[key]
            ok = found.name.rsplit(".", 1)[-1] == wanted.rsplit(".", 1)[-1] and found.external == bool(
                boundary.wrapped_as
            )
        except HpgenError:
            ok = False
        if not ok:
            classes[key] = wanted
    return classes
