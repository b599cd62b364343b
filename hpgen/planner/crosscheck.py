"""transformers' plan checked against the source: blocks the code contradicts fall back.

hpgen translates transformers' ``base_model_tp_plan`` because it is the interchange format,
but a hand-written plan can shard a block whose code does not allow it: in Doge the
``rowwise`` ``dt_proj`` reads the value projection's output whole to build the attention
mask, while the scores hold only this rank's heads. The derivation
(:mod:`hpgen.planner.derive`) follows each value through the layer's ``forward`` and records
such a group as contradicted (:class:`~hpgen.planner.entries.Contradicted`), naming the
module that needs the value whole. A block of transformers' plan that shards that very
module is dropped (an MLA ``kv_a_layernorm``, which transformers keeps replicated, leaves
the plan as it is): the group stays
replicated, as the plan derived from the source leaves it, and the plan's comments say so
(``replaced``, printed by ``hpgen plan --explain``).
"""

from __future__ import annotations

from typing import Any

from hpgen.planner.entries import Derivation

__all__ = ["drop_contradicted"]


def drop_contradicted(plan: dict[str, Any], derivation: Derivation) -> dict[str, Any]:
    """``plan`` without the blocks whose sharded modules the derivation found contradicted."""
    contradicted = [note for note in derivation.notes if note.needs_whole and not note.sharded]
    dropped: dict[str, str] = {}
    for key, entry in plan["param_plan"].items():
        sharded = {
            name.rpartition(".")[0] for name, layout in entry.get("params", {}).items() if set(layout.values()) != {"R"}
        }
        for note in contradicted:
            consumer = note.needs_whole[len(key) + 1 :] if note.needs_whole.startswith(key + ".") else None
            if consumer is not None and consumer in sharded:  # transformers shards what needs the value whole
                dropped[key] = (
                    f"transformers' plan shards {consumer} here, but the source contradicts it: {note.text}; "
                    "kept replicated, as the plan derived from the source does"
                )
                break
    if not dropped:
        return plan
    result = dict(plan)
    result["param_plan"] = {key: entry for key, entry in plan["param_plan"].items() if key not in dropped}
    classes = {key: name for key, name in plan.get("boundary_classes", {}).items() if key not in dropped}
    result.pop("boundary_classes", None)
    if classes:
        result["boundary_classes"] = classes
    result["injections"] = [i for i in plan.get("injections", []) if i.get("match") not in dropped]
    if not result["injections"]:
        result.pop("injections")
    result["comments"] = {**plan.get("comments", {}), "replaced": dict(sorted(dropped.items()))}
    return result
