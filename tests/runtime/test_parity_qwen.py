"""Qwen2, Qwen3 and Qwen3-MoE parallelized over 2 gloo ranks against the unsharded models.

- Qwen2: q/k/v projections with biases, sharded with their heads.
- Qwen3: per-head ``q_norm``/``k_norm``, whose gradients are partial under head sharding
  (``grad_reduce_params``); vocab-parallel embedding and column-parallel lm_head.
- Qwen3-MoE: attention tensor-parallel and the experts expert-parallel on the same two
  ranks, through the region form and ``hpgen.runtime.local.experts_parallel``; once more
  with an ``inner_wrapper`` around that function.
- Qwen3-MoE with the plans ``hpgen plan`` writes for the tiny config: transformers'
  ``moe_tp_experts`` (each expert's intermediate dim sharded, partial sums all-reduced)
  and, with ``--ep 2``, the experts sharded on the expert dim.

Every model runs with transformers' defaults: sdpa attention and the ``grouped_mm``
experts kernel, which ``parallelize`` must run inside the generated ``forward``.
"""

from __future__ import annotations

import pytest

from tests.dist import run_distributed
from tests.runtime.models import (
    Case,
    check_generation,
    check_gradients,
    check_logits,
    check_state_dict_keys,
    load_plan_dict,
    lower_family,
    make_config,
    run_cases,
)

CASES = {
    "qwen2": "qwen2_tp",
    "qwen3": "qwen3_tp",
    "qwen3_moe": "qwen3_moe_tp_ep",
    "qwen3_moe_wrapped": None,
    "qwen3_moe_hpgen_tp": None,
    "qwen3_moe_hpgen_ep": None,
}


def _wrapped_moe_plan() -> dict:
    """The MoE plan with an ``inner_wrapper`` around the experts' local compute function."""
    plan = load_plan_dict("qwen3_moe_tp_ep")
    plan["injections"][0]["inner_wrapper"] = {"_target_": "tests.runtime.models.recording", "label": "experts"}
    return plan


def _hpgen_plan(**sizes: int) -> dict:
    """What ``hpgen plan`` writes for the tiny Qwen3-MoE config."""
    from hpgen.tp_plan import meta_model, plan_for_model

    return plan_for_model(meta_model(make_config("qwen3_moe")), **sizes)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = tmp_path_factory.mktemp("qwen")
    files = {family: str(lower_family(family, plan, directory)) for family, plan in CASES.items() if plan}
    cases = [Case(family, family, files[family], load_plan_dict(plan)) for family, plan in CASES.items() if plan]
    # the inner wrapper does not change the contract: the same generated file serves
    cases.append(Case("qwen3_moe_wrapped", "qwen3_moe", files["qwen3_moe"], _wrapped_moe_plan()))
    for name, plan in (("qwen3_moe_hpgen_tp", _hpgen_plan(tp=2)), ("qwen3_moe_hpgen_ep", _hpgen_plan(tp=2, ep=2))):
        generated = directory / f"{name}.py"
        generated.write_text(lower_family("qwen3_moe", plan, directory).read_text())
        cases.append(Case(name, "qwen3_moe", str(generated), plan))
    return run_distributed(run_cases, cases, timeout=300)


def test_hpgen_plans_cover_both_expert_layouts() -> None:
    # the two plans differ where it matters: experts' intermediate dim vs the expert dim
    tp = _hpgen_plan(tp=2)["param_plan"]["model.layers.*.mlp.experts"]["params"]
    ep = _hpgen_plan(tp=2, ep=2)["param_plan"]["model.layers.*.mlp.experts"]["params"]
    assert tp["down_proj"] == {"tp": "S(2)"} and ep["down_proj"] == {"tp": "S(0)"}


@pytest.mark.parametrize("name", CASES)
def test_logits(results: list[dict], name: str) -> None:
    check_logits(results, name)


@pytest.mark.parametrize("name", CASES)
def test_state_dict_keys_unchanged(results: list[dict], name: str) -> None:
    check_state_dict_keys(results, name)


@pytest.mark.parametrize("name", CASES)
def test_gradients(results: list[dict], name: str) -> None:
    check_gradients(results, name)


@pytest.mark.parametrize("name", CASES)
def test_greedy_generation(results: list[dict], name: str) -> None:
    check_generation(results, name)


def test_inner_wrapper_wraps_the_local_compute(results: list[dict]) -> None:
    for by_case in results:
        assert by_case["qwen3_moe_wrapped"].region_calls == ["experts", "experts"]  # one per MoE layer
        assert by_case["qwen3_moe"].region_calls == []
