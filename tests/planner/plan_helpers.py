"""Plans of tiny models built on the meta device, and what the planner tests read from them."""

from __future__ import annotations

from typing import Any

from tests.support.derived_configs import tiny


def placements(placed) -> dict[str, str]:
    """A derived entry's parameter placements, as the plan writes them."""
    return {name: str(placement) for name, placement in placed.params.items()}


def derived(family: str, tp: int = 2) -> dict[str, Any]:
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    return plan_model(meta_model(tiny(family)), tp=tp, from_source=True, name=family)


def entry(plan: dict[str, Any], key: str) -> dict[str, Any]:
    assert key in plan["param_plan"], sorted(plan["param_plan"])
    return plan["param_plan"][key]


def translated(model_type: str) -> tuple[Any, dict[str, Any]]:
    """transformers' plan of ``model_type``'s tiny config (the coverage table's), on the meta device."""
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model
    from hpgen.verify.shrink import tiny_config

    model = meta_model(tiny_config(model_type))
    return model, plan_model(model, tp=2, name=model_type)


def plan_model_of(family: str) -> dict[str, Any]:
    """``hpgen plan --tp 2`` of ``family``'s tiny config (transformers' plan where it has one)."""
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    return plan_model(meta_model(tiny(family)), tp=2, name=family)
