"""transformers' plan checked against the source: blocks the code contradicts fall back.

hpgen translates transformers' ``base_model_tp_plan`` because it is the interchange format,
but a hand-written plan can shard a block whose code does not allow it: a value computed
from the column-parallel projections reaches a module that needs it whole. The derivation
(:mod:`hpgen.planner.derive.derivation`) follows each value through the layer's ``forward`` and records
such a group as contradicted (:class:`~hpgen.planner.derive.placed.Contradicted`), naming the
module that needs the value whole. A block of transformers' plan that shards that very
module is dropped (an MLA ``kv_a_layernorm``, which transformers keeps replicated, leaves
the plan as it is): the group stays replicated, as the plan derived from the source leaves
it, and the plan's comments say so (``replaced``, printed by ``hpgen plan --explain``).
Likewise a block instance whose ``forward`` reduces the features of a column-sharded value
(:func:`drop_feature_statistics`).

Where the derivation shards that module itself, gathering its input on entry (a gathered
column, :mod:`hpgen.planner.derive.gathered`: Doge's ``dt_proj``, which transformers' plan makes
``rowwise`` although it reads every value head to build one mask row per head), the block
of transformers' plan is dropped for the derived one (:func:`drop_regathered`):
transformers' styles cannot say "gather the input, keep the output sharded".
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hpgen.planner.derive.placed import Derivation
from hpgen.planner.translate.draft import DraftEntry, DraftPlan

__all__ = ["drop_contradicted", "drop_feature_statistics", "drop_regathered"]


def drop_contradicted(plan: DraftPlan, derivation: Derivation) -> DraftPlan:
    """``plan`` without the blocks whose sharded modules the derivation found contradicted."""
    contradicted = [note for note in derivation.notes if note.needs_whole and not note.sharded]
    dropped = {
        key: (
            f"transformers' plan shards {consumer} here, but the source contradicts it: {note.text}; "
            "kept replicated, as the plan derived from the source does"
        )
        for key, consumer, note in _sharding_consumers(plan, contradicted)
    }
    return _without(plan, dropped) if dropped else plan


def drop_regathered(plan: DraftPlan, derivation: Derivation) -> tuple[DraftPlan, set[str]]:
    """``plan`` without its blocks that shard a module the derivation gathers the input of; their keys.

    The keys dropped are for the derived blocks to take their place (:func:`hpgen.planner.entry.make.plan_model`).
    """
    gathered = [note for note in derivation.notes if note.needs_whole and note.sharded]
    dropped = {
        key: (
            f"transformers' plan shards {consumer} here, but it reads a sharded projection's output whole; "
            f"derived from the source instead: {consumer} is column-parallel over its outputs (one per head) "
            "and gathers its input on entry"
        )
        for key, consumer, _ in _sharding_consumers(plan, gathered)
    }
    return (_without(plan, dropped), set(dropped)) if dropped else (plan, set())


def _sharding_consumers(plan: DraftPlan, notes: list[Any]) -> list[tuple[str, str, Any]]:
    """(plan key, consumer, note) for each entry of ``plan`` that shards the module a note says needs its
    input whole (``note.needs_whole``, relative to the entry's key); the first such note per entry."""
    found = []
    for key, entry in plan.entries.items():
        sharded = entry.sharded_modules()
        for note in notes:
            consumer = note.needs_whole[len(key) + 1 :] if note.needs_whole.startswith(key + ".") else None
            if consumer is not None and consumer in sharded:  # transformers shards what needs the value whole
                found.append((key, consumer, note))
                break
    return found


def _without(plan: DraftPlan, dropped: dict[str, str]) -> DraftPlan:
    """``plan`` without the entries ``dropped`` names, each listed with its reason under ``replaced``."""
    replaced = {**plan.comments.get("replaced", {}), **dropped}
    return plan.replace(
        entries={key: entry for key, entry in plan.entries.items() if key not in dropped},
        boundary_classes={key: name for key, name in plan.boundary_classes.items() if key not in dropped},
        injections=tuple(item for item in plan.injections if item.match not in dropped),
    ).with_comments(replaced=dict(sorted(replaced.items())))


def drop_feature_statistics(model: Any, plan: DraftPlan) -> DraftPlan:
    """``plan`` without the block instances that reduce the features of a column-sharded value.

    Gemma3n's MLP thresholds its gate projection by the mean and standard deviation of its
    features (``_gaussian_topk``, in the layers whose ``activation_sparsity`` is above 0): with
    the gate column-parallel each rank would use its own shard's statistics. Those instances
    stay replicated; a ``*`` key whose other instances still shard is written per instance.
    """
    from hpgen.planner.model.load import index_source, source_file
    from hpgen.planner.passes.feature_statistics import feature_statistics

    trees: dict[str, Any] = {}
    why: dict[str, str] = {}  # concrete FQN -> reason
    members: dict[str, list[str]] = {}
    for fqn, module in model.named_modules():
        found = plan.entry_for(fqn) if fqn else None
        if found is None or not found[1].is_boundary:
            continue
        key, entry = found
        members.setdefault(key, []).append(fqn)
        columns = {
            name.rpartition(".")[0]
            for name, layout in entry.params.items()
            if name.endswith(".weight") and any(p.kind == "S" and p.dim in (0, -2) for _, p in layout.placements)
        }
        columns = {c for c in columns if c and "." not in c}
        if not columns or "forward" not in vars(type(module)):
            continue
        try:
            path = source_file(type(module))
            if path not in trees:
                trees[path] = index_source(Path(path))[0].tree
        except Exception:  # torch's own classes, files that do not parse: nothing to read
            continue
        found = feature_statistics(trees[path], type(module).__name__, columns, module)
        if found is not None:
            why[fqn] = found
    if not why:
        return plan
    entries: dict[str, DraftEntry] = {}
    classes = dict(plan.boundary_classes)
    replaced: dict[str, str] = {}
    for key, entry in plan.entries.items():
        bad = [fqn for fqn in members.get(key, []) if fqn in why]
        if not bad:
            entries[key] = entry
            continue
        for fqn in members[key]:
            if fqn in why:
                replaced[fqn] = (
                    f"transformers' plan shards it column-parallel, but {why[fqn]}: each rank would compute "
                    "statistics of its own shard; kept replicated"
                )
            else:
                entries[fqn] = entry
                if key in classes:
                    classes[fqn] = classes[key]
        classes.pop(key, None)
    result = plan.replace(entries=entries, boundary_classes=classes).with_comments(
        replaced={**plan.comments.get("replaced", {}), **replaced}
    )
    result.validated(name="hpgen plan")  # what we write must load
    return result
