"""``hpgen plan``: transformers' plan where it shards the layers, else the plan derived from the source.

transformers' ``base_model_tp_plan`` is the interchange format users know, so where it
exists and shards something inside the decoder layers it is translated
(:mod:`hpgen.planner.translate.translator`). Where there is none, or where it shards only the embeddings
(bamba, diffllama, gpt_oss, lfm2, ...), the plan is derived from the modeling source
(:mod:`hpgen.planner.derive.derivation`); ``from_source`` forces that, and so do heads that do not divide
``--tp`` in a fused projection transformers' plan shards whole (GPT-NeoX's ``query_key_value``:
the source says how its heads are laid out; ``comments.derived_because`` says so). A translated plan that leaves
whole blocks replicated (the attention next to sharded experts) gets those blocks from the
derivation too (without ``--sp``/``--ep``). Either way the plan's top-level ``comments``
(ignored by the loader) say where it came from and, for a derived plan, what was sharded
and why the rest was not.
"""

from __future__ import annotations

from typing import Any

from hpgen.core.errors import HpgenError
from hpgen.core.plan_names import fqn_matches
from hpgen.planner.translate.draft import DraftPlan

__all__ = ["TRANSFORMERS", "DERIVED", "make_plan", "plan_model", "plan_source", "transformers_shards_layers"]

TRANSFORMERS = "transformers' plan"
DERIVED = "derived from the source"


def make_plan(
    target: str,
    *,
    tp: int | None = None,
    ep: int | None = None,
    sp: bool = False,
    ep_axis: str | None = None,
    from_source: bool = False,
    summed: bool = True,
    cp: int | None = None,
) -> dict[str, Any]:
    """The frozen plan for a model type or config.json (see :func:`plan_model`)."""
    from hpgen.planner.model.load import load_config, meta_model

    return plan_model(
        meta_model(load_config(target)),
        tp=tp,
        ep=ep,
        sp=sp,
        ep_axis=ep_axis,
        from_source=from_source,
        name=target,
        summed=summed,
        cp=cp,
    )


def transformers_shards_layers(model: Any) -> bool:
    """Whether the model's transformers tp_plan shards something inside the layers (a ``*`` key).

    The experts count where only the EP plan names them (transformers >= 5.25, see
    :mod:`hpgen.planner.translate.expert_tp`).
    """
    from hpgen.planner.translate.expert_tp import model_tp_plan

    plan = model_tp_plan(model)
    return any("*" in key or any(part.isdigit() for part in key.split(".")) for key in plan)


def plan_source(model: Any, *, from_source: bool = False) -> str:
    """:data:`TRANSFORMERS` or :data:`DERIVED`: which plan :func:`plan_model` writes for ``model``."""
    return DERIVED if from_source or not transformers_shards_layers(model) else TRANSFORMERS


def plan_model(
    model: Any,
    *,
    tp: int | None = None,
    ep: int | None = None,
    sp: bool = False,
    from_source: bool = False,
    ep_axis: str | None = None,
    name: str | None = None,
    summed: bool = True,
    cp: int | None = None,
) -> dict[str, Any]:
    """The frozen plan for ``model`` (an instance, normally on the meta device); ``ep_axis`` as for
    :func:`hpgen.planner.translate.translator.translated_plan` (transformers' plans only). A plan whose boundaries live
    in several modeling files names each class by file (:func:`hpgen.planner.passes.modeling_files.name_files`).
    ``summed``: parallel-residual blocks reduce their two branches once (:mod:`hpgen.planner.passes.summed_reductions`).
    ``cp``: the sequence cut over a ``cp`` axis outside the tensor-parallel one (:mod:`hpgen.planner.passes.context_parallel`);
    without ``tp``, ``sp`` or ``ep`` the plan is context-parallel alone."""
    from hpgen.planner.passes.modeling_files import name_files
    from hpgen.planner.passes.summed_reductions import add_summed_reductions

    name = name or type(model).__name__
    plan = None
    if cp is None or tp is not None or sp or ep is not None:
        plan = _plan_model(model, tp=tp, ep=ep, sp=sp, from_source=from_source, ep_axis=ep_axis, name=name)
        if summed:
            plan = add_summed_reductions(model, plan)
    if cp is not None:
        from hpgen.planner.passes.context_parallel import context_parallel

        plan = context_parallel(model, plan, cp=cp, name=name)
    return name_files(model, plan).document()  # the one place the plan becomes a document


def _plan_model(
    model: Any, *, tp: int | None, ep: int | None, sp: bool, from_source: bool, ep_axis: str | None, name: str
) -> DraftPlan:
    from hpgen.planner.translate.axis_checks import HeadsNotCut
    from hpgen.planner.translate.translator import translated_draft

    uncut = None
    if plan_source(model, from_source=from_source) == TRANSFORMERS:
        try:
            plan = translated_draft(model, tp=tp, ep=ep, sp=sp, ep_axis=ep_axis, name=name)
        except HeadsNotCut as error:
            if ep is not None:
                raise
            uncut = str(error)  # a fused projection: the derivation reads how its heads are laid out
    if plan_source(model, from_source=from_source) == TRANSFORMERS and uncut is None:
        plan = plan.replace(comments={"plan_source": TRANSFORMERS, **plan.comments})
        if ep is None and not sp:
            plan = _completed(model, plan, tp=tp, name=name)
        elif ep is None:
            plan = _regathered_sp(model, plan, tp=tp, name=name)
        return plan
    if ep is not None:
        raise HpgenError(
            f"{name}: --ep shards experts by transformers' base_model_ep_plan; the plan derived from the source "
            "is tensor parallel only (its experts shard on --tp)"
        )
    from hpgen.planner.derive.derivation import derive
    from hpgen.planner.translate.derived_plan import derived_plan

    derivation = derive(model, tp=tp)
    if derivation.no_query_head:  # no cut of this --tp gives every rank a query head
        raise HpgenError(f"{name}: {derivation.no_query_head}")
    if not derivation.placed:
        raise HpgenError(f"{name}: nothing to shard: {_reasons(derivation)}")
    plan = derived_plan(model, derivation, tp=tp, sp=sp, name=name)
    return plan.replace(
        comments={
            "plan_source": DERIVED,
            **({"derived_because": uncut} if uncut is not None else {}),
            "sharded": {note.target: note.text for note in derivation.notes if note.sharded},
            "replicated": {note.target: note.text for note in derivation.notes if not note.sharded},
        }
    )


def _completed(model: Any, plan: DraftPlan, *, tp: int | None, name: str) -> DraftPlan:
    """transformers' plan, plus the derived groups of the layers it leaves replicated.

    Some plans shard only part of each layer (the experts but not the attention, the
    attention but not a dense MLP). The derivation's whole blocks that touch no module the
    plan already matches are added; the vocabulary stays as transformers' plan has it. The
    comments list what was added. First, blocks of transformers' plan that the source
    contradicts are dropped (:mod:`hpgen.planner.passes.crosscheck`).
    """
    from hpgen.core.errors import HpgenError as _Error
    from hpgen.planner.derive.derivation import derive
    from hpgen.planner.derive.placed import Derivation, Kind
    from hpgen.planner.passes.crosscheck import drop_contradicted, drop_feature_statistics, drop_regathered
    from hpgen.planner.translate.derived_plan import derived_plan

    plan = drop_feature_statistics(model, plan)  # block instances reducing a sharded value's features
    try:
        derivation = derive(model, tp=tp)
    except Exception as error:  # completing is optional: transformers' plan stands, and the plan says why
        return plan.with_comments(completion_skipped=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    plan = drop_contradicted(plan, derivation)  # blocks of transformers' plan that the source contradicts
    plan, regathered = drop_regathered(plan, derivation)  # ... or shards otherwise than the derived blocks do
    taken = [fqn for fqn, _ in model.named_modules() if fqn and plan.entry_for(fqn) is not None]
    # what the cross-checks kept replicated is not completed back either
    kept = {key: text for key, text in plan.comments.get("replaced", {}).items() if key not in regathered}
    taken += [fqn for fqn, _ in model.named_modules() if fqn and _matches_any(fqn, kept)]
    extra = Derivation()
    for fqn, placed in derivation.placed.items():
        # whole blocks only (a module returning its row's output alone): what transformers' authors
        # left replicated around a residual or a grouped projection stays as they left it
        # or a state-space mixer's pair, or a row on its split replicated input (self-contained: R in, R out)
        if not placed.kind.self_contained:
            continue
        if any(fqn == t or t.startswith(fqn + ".") or fqn.startswith(t + ".") for t in taken):
            continue
        mixer = fqn.rpartition(".")[0]
        if placed.kind is not Kind.BLOCK and any(t.startswith(mixer + ".") for t in taken):
            continue  # a mixer's gathered pair goes in whole or not at all (Lara keeps in_proj_* replicated)
        extra.placed[fqn] = placed
    for fqn, placed in derivation.placed.items():
        inside = any(fqn == b or fqn.startswith(b + ".") for b in extra.placed)
        # sizes, a mixer's reduced x_proj, a gathered column (Doge's dt_proj)
        if placed.kind.completes_with_its_block and inside:
            extra.placed[fqn] = placed
    if not any(p.kind is not Kind.ATTRS for p in extra.placed.values()):
        return plan
    try:
        addition = derived_plan(model, extra, tp=tp, name=name)
        merged = plan.replace(
            entries={**plan.entries, **addition.entries},
            boundary_classes={**plan.boundary_classes, **addition.boundary_classes},
        )
        merged.validated(name=f"hpgen plan {name}")
    except _Error:
        return plan  # the addition does not fit transformers' plan: keep the plan as transformers wrote it
    added = {note.target for note in derivation.notes if note.sharded} & set(addition.entries)
    return merged.with_comments(
        plan_source=TRANSFORMERS,
        completed_from_source={
            note.target: note.text for note in derivation.notes if note.sharded and note.target in added
        },
    )


def _regathered_sp(model: Any, plan: DraftPlan, *, tp: int | None, name: str) -> DraftPlan:
    """``--sp``: transformers' blocks that shard a gathered column otherwise, replaced by the derived blocks.

    Without ``--sp`` :func:`_completed` does this along with the rest. With it, only the blocks of
    transformers' plan that shard a module the derivation gathers the input of (Doge's ``dt_proj``)
    are swapped for the derived ones, entered from the sequence-sharded stream like the blocks around
    them; where the derived blocks do not fit, the dropped blocks stay replicated.
    """
    from hpgen.core.errors import HpgenError as _Error
    from hpgen.planner.derive.derivation import derive
    from hpgen.planner.derive.placed import Derivation
    from hpgen.planner.passes.crosscheck import drop_regathered
    from hpgen.planner.translate.derived_plan import derived_plan

    try:
        derivation = derive(model, tp=tp)
    except Exception:  # the derivation is a cross-check here: transformers' plan stands without it
        return plan
    trimmed, keys = drop_regathered(plan, derivation)
    if not keys:
        return plan
    extra = Derivation(
        placed={fqn: p for fqn, p in derivation.placed.items() if _matches_any_prefix(fqn, keys)},
        notes=list(derivation.notes),
    )
    try:
        addition = derived_plan(model, extra, tp=tp, sp=True, name=name)
        entries = {key: entry for key, entry in addition.entries.items() if _matches_any_prefix(key, keys)}
        classes = {**trimmed.boundary_classes}
        classes.update({key: cls for key, cls in addition.boundary_classes.items() if key in entries})
        merged = trimmed.replace(entries={**trimmed.entries, **entries}, boundary_classes=classes)
        merged.validated(name=f"hpgen plan {name}")
    except _Error:
        return trimmed
    return merged


def _matches_any_prefix(fqn: str, patterns: Any) -> bool:
    """Whether ``fqn`` (or a plan key) or a module above it is one of ``patterns`` (``*`` for one segment)."""
    parts = fqn.split(".")
    return any(_matches_any(".".join(parts[:n]), patterns) for n in range(1, len(parts) + 1))


def _matches_any(fqn: str, patterns: Any) -> bool:
    """Whether a plan key (``*`` for one segment) of ``patterns`` matches ``fqn``."""
    return any(fqn_matches(key, fqn) for key in patterns)


def _reasons(derivation: Any) -> str:
    notes = [f"{note.target}: {note.text}" for note in derivation.notes if not note.sharded][:3]
    return "; ".join(notes) or "no decoder layer, embedding or output projection hpgen recognises"
