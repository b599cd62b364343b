"""transformers' plan checked against the source: blocks the code contradicts fall back.

hpgen translates transformers' ``base_model_tp_plan`` because it is the interchange format,
but a hand-written plan can shard a block whose code does not allow it: a value computed
from the column-parallel projections reaches a module that needs it whole. The derivation
(:mod:`hpgen.planner.derive`) follows each value through the layer's ``forward`` and records
such a group as contradicted (:class:`~hpgen.planner.entries.Contradicted`), naming the
module that needs the value whole. A block of transformers' plan that shards that very
module is dropped (an MLA ``kv_a_layernorm``, which transformers keeps replicated, leaves
the plan as it is): the group stays replicated, as the plan derived from the source leaves
it, and the plan's comments say so (``replaced``, printed by ``hpgen plan --explain``).
Likewise a block instance whose ``forward`` reduces the features of a column-sharded value
(:func:`drop_feature_statistics`).

Where the derivation shards that module itself, gathering its input on entry (a gathered
column, :mod:`hpgen.planner.gathered`: Doge's ``dt_proj``, which transformers' plan makes
``rowwise`` although it reads every value head to build one mask row per head), the block
of transformers' plan is dropped for the derived one (:func:`drop_regathered`):
transformers' styles cannot say "gather the input, keep the output sharded".
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hpgen.placement import Placement
from hpgen.planner.entries import Derivation

__all__ = ["drop_contradicted", "drop_feature_statistics", "drop_regathered"]


def drop_contradicted(plan: dict[str, Any], derivation: Derivation) -> dict[str, Any]:
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


def drop_regathered(plan: dict[str, Any], derivation: Derivation) -> tuple[dict[str, Any], set[str]]:
    """``plan`` without its blocks that shard a module the derivation gathers the input of; their keys.

    The keys dropped are for the derived blocks to take their place (:func:`hpgen.planner.make.plan_model`).
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


def _sharding_consumers(plan: dict[str, Any], notes: list[Any]) -> list[tuple[str, str, Any]]:
    """(plan key, consumer, note) for each entry of ``plan`` that shards the module a note says needs its
    input whole (``note.needs_whole``, relative to the entry's key); the first such note per entry."""
    found = []
    for key, entry in plan["param_plan"].items():
        sharded = {
            name.rpartition(".")[0]
            for name, layout in entry.get("params", {}).items()
            if not all(Placement.parse(text).is_replicate for text in layout.values())
        }
        for note in notes:
            consumer = note.needs_whole[len(key) + 1 :] if note.needs_whole.startswith(key + ".") else None
            if consumer is not None and consumer in sharded:  # transformers shards what needs the value whole
                found.append((key, consumer, note))
                break
    return found


def _without(plan: dict[str, Any], dropped: dict[str, str]) -> dict[str, Any]:
    """``plan`` without the entries ``dropped`` names, each listed with its reason under ``replaced``."""
    result = dict(plan)
    result["param_plan"] = {key: entry for key, entry in plan["param_plan"].items() if key not in dropped}
    classes = {key: name for key, name in plan.get("boundary_classes", {}).items() if key not in dropped}
    result.pop("boundary_classes", None)
    if classes:
        result["boundary_classes"] = classes
    result["injections"] = [i for i in plan.get("injections", []) if i.get("match") not in dropped]
    if not result["injections"]:
        result.pop("injections")
    replaced = {**plan.get("comments", {}).get("replaced", {}), **dropped}
    result["comments"] = {**plan.get("comments", {}), "replaced": dict(sorted(replaced.items()))}
    return result


def drop_feature_statistics(model: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` without the block instances that reduce the features of a column-sharded value.

    Gemma3n's MLP thresholds its gate projection by the mean and standard deviation of its
    features (``_gaussian_topk``, in the layers whose ``activation_sparsity`` is above 0): with
    the gate column-parallel each rank would use its own shard's statistics. Those instances
    stay replicated; a ``*`` key whose other instances still shard is written per instance.
    """
    from hpgen.plan import plan_from_dict
    from hpgen.planner.corrections import feature_statistics
    from hpgen.planner.load import index_source, source_file

    loaded = plan_from_dict(plan)
    trees: dict[str, Any] = {}
    why: dict[str, str] = {}  # concrete FQN -> reason
    members: dict[str, list[str]] = {}
    for fqn, module in model.named_modules():
        entry = loaded.entry_for(fqn) if fqn else None
        if entry is None or not entry.is_boundary:
            continue
        members.setdefault(entry.key, []).append(fqn)
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
    result = dict(plan)
    param_plan: dict[str, Any] = {}
    classes = dict(plan.get("boundary_classes", {}))
    replaced: dict[str, str] = {}
    for key, entry in plan["param_plan"].items():
        bad = [fqn for fqn in members.get(key, []) if fqn in why]
        if not bad:
            param_plan[key] = entry
            continue
        for fqn in members[key]:
            if fqn in why:
                replaced[fqn] = (
                    f"transformers' plan shards it column-parallel, but {why[fqn]}: each rank would compute "
                    "statistics of its own shard; kept replicated"
                )
            else:
                param_plan[fqn] = entry
                if key in classes:
                    classes[fqn] = classes[key]
        classes.pop(key, None)
    result["param_plan"] = param_plan
    result.pop("boundary_classes", None)
    if classes:
        result["boundary_classes"] = classes
    result["comments"] = {**plan.get("comments", {}), "replaced": {**plan.get("comments", {}).get("replaced", {}), **replaced}}
    plan_from_dict(result, name="hpgen plan")  # what we write must load
    return result
