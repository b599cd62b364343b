"""``hpgen plan``: transformers' plan where it shards the layers, else the plan derived from the source.

transformers' ``base_model_tp_plan`` is the interchange format users know, so where it
exists and shards something inside the decoder layers it is translated
(:mod:`hpgen.tp_plan`). Where there is none, or where it shards only the embeddings
(bamba, diffllama, gpt_oss, lfm2, ...), the plan is derived from the modeling source
(:mod:`hpgen.planner.derive`); ``from_source`` forces that. Either way the plan's
top-level ``comments`` (ignored by the loader) say where it came from and, for a derived
plan, what was sharded and why the rest was not.
"""

from __future__ import annotations

from typing import Any

from hpgen.errors import HpgenError

__all__ = ["TRANSFORMERS", "DERIVED", "make_plan", "plan_model", "plan_source", "transformers_shards_layers"]

TRANSFORMERS = "transformers' plan"
DERIVED = "derived from the source"


def make_plan(
    target: str, *, tp: int | None = None, ep: int | None = None, sp: bool = False, from_source: bool = False
) -> dict[str, Any]:
    """The frozen plan for a model type or config.json (see :func:`plan_model`)."""
    from hpgen.tp_plan import load_config, meta_model

    return plan_model(meta_model(load_config(target)), tp=tp, ep=ep, sp=sp, from_source=from_source, name=target)


def transformers_shards_layers(model: Any) -> bool:
    """Whether the model's transformers tp_plan shards something inside the layers (a ``*`` key)."""
    plan = dict(getattr(model, "tp_plan", None) or {})
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
    name: str | None = None,
) -> dict[str, Any]:
    """The frozen plan for ``model`` (an instance, normally on the meta device)."""
    from hpgen.tp_plan import plan_for_model

    name = name or type(model).__name__
    if plan_source(model, from_source=from_source) == TRANSFORMERS:
        plan = plan_for_model(model, tp=tp, ep=ep, sp=sp, name=name)
        plan["comments"] = {"plan_source": TRANSFORMERS}
        return plan
    if ep is not None:
        raise HpgenError(
            f"{name}: --ep shards experts by transformers' base_model_ep_plan; the plan derived from the source "
            "is tensor parallel only (its experts shard on --tp)"
        )
    from hpgen.planner.derive import derive
    from hpgen.planner.translate import derived_plan

    derivation = derive(model, tp=tp)
    if not derivation.placed:
        raise HpgenError(f"{name}: nothing to shard: {_reasons(derivation)}")
    plan = derived_plan(model, derivation, tp=tp, sp=sp, name=name)
    plan["comments"] = {
        "plan_source": DERIVED,
        "sharded": {note.target: note.text for note in derivation.notes if note.sharded},
        "replicated": {note.target: note.text for note in derivation.notes if not note.sharded},
    }
    return plan


def _reasons(derivation: Any) -> str:
    notes = [f"{note.target}: {note.text}" for note in derivation.notes if not note.sharded][:3]
    return "; ".join(notes) or "no decoder layer, embedding or output projection hpgen recognises"
