"""Qwen2, Qwen3 and Qwen3-MoE parallelized over 2 gloo ranks against the unsharded models.

- Qwen2: q/k/v projections with biases, sharded with their heads.
- Qwen3: per-head ``q_norm``/``k_norm``, whose gradients are partial under head sharding
  (``grad_reduce_params``); vocab-parallel embedding and column-parallel lm_head.
- Qwen3-MoE: attention tensor-parallel and the experts expert-parallel on the same two
  ranks, through the region form and ``hpgen.runtime.local.experts_parallel``; once more
  with an ``inner_wrapper`` around that function.
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
    run_cases,
)

CASES = {"qwen2": "qwen2_tp", "qwen3": "qwen3_tp", "qwen3_moe": "qwen3_moe_tp_ep", "qwen3_moe_wrapped": None}


def _wrapped_moe_plan() -> dict:
    """The MoE plan with an ``inner_wrapper`` around the experts' local compute function."""
    plan = load_plan_dict("qwen3_moe_tp_ep")
    plan["injections"][0]["inner_wrapper"] = {"_target_": "tests.runtime.models.recording", "label": "experts"}
    return plan


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = tmp_path_factory.mktemp("qwen")
    files = {family: str(lower_family(family, plan, directory)) for family, plan in CASES.items() if plan}
    cases = [Case(family, family, files[family], load_plan_dict(plan)) for family, plan in CASES.items() if plan]
    # the inner wrapper does not change the contract: the same generated file serves
    cases.append(Case("qwen3_moe_wrapped", "qwen3_moe", files["qwen3_moe"], _wrapped_moe_plan()))
    return run_distributed(run_cases, cases, timeout=300)


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
