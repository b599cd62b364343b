"""The plans ``hpgen plan`` writes where heads do not divide ``--tp``, run on gloo ranks against the unsharded model.

tests/runtime/forward/test_parity_heads.py proves the runtime on hand-written ``hpgen.plan/2``
plans; these prove the planner's own: the plan is made by
:func:`hpgen.planner.entry.make.plan_model` from the config on the meta device, exactly as ``hpgen
plan --tp N`` writes it, lowered, parallelized and compared (logits, every gradient, greedy
generation with the cache; :mod:`tests.support.heads_cases`). Two spawns:

- 4 ranks: a Qwen2-0.5B-shaped model (14 query, 2 key/value heads, q/k/v biases) at tp 4,
  from transformers' plan (``S(0,8,2)`` beside ``RS(0,2)``, ``num_key_value_groups`` per
  rank) and derived from the source;
- 2 ranks: multi-query Falcon (transformers' default architecture) with 7 heads, and with
  ``new_decoder_architecture`` and one key/value head: ``B(0, 56:S(0,8), 8:R, 8:R)``, the
  attention and MLP reduced once a layer (profiler-free count of ``all_reduce`` calls).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_distributed
from tests.support.heads_cases import check, falcon_config, llama_config, lowered, run_cases

LAYERS = 2  # the tiny configs' decoder layers


def _planned(config: Any, tp: int, *, from_source: bool = False) -> dict[str, Any]:
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    return plan_model(meta_model(config), tp=tp, from_source=from_source)


def _cases(directory: Path, named: dict[str, tuple[Any, dict[str, Any]]]) -> dict[str, tuple[Any, dict[str, Any], str]]:
    return {name: (config, plan, lowered(config, plan, str(directory / f"{name}.py"))) for name, (config, plan) in named.items()}


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("planned_heads")


@pytest.fixture(scope="module")
def results4(directory: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    config = llama_config(14, 2, "qwen2")
    named = {"qwen2_14_2": (config, _planned(config, 4)), "qwen2_14_2_derived": (config, _planned(config, 4, from_source=True))}
    cases = _cases(directory, named)
    return cases, run_distributed(run_cases, cases, world_size=4, timeout=400)


@pytest.fixture(scope="module")
def results2(directory: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    multi_query = falcon_config(7)
    new_architecture = falcon_config(7)
    new_architecture.new_decoder_architecture = True
    new_architecture.num_kv_heads = 1
    named = {"falcon_7": (multi_query, _planned(multi_query, 2)), "falcon_7_nda": (new_architecture, _planned(new_architecture, 2))}
    cases = _cases(directory, named)
    return cases, run_distributed(run_cases, cases, world_size=2, timeout=400)


@pytest.mark.parametrize("name", ["qwen2_14_2", "qwen2_14_2_derived"])
def test_planned_qwen2_14_2_at_tp4(results4: tuple[dict[str, Any], list[dict[str, Any]]], name: str) -> None:
    cases, results = results4
    attention = cases[name][1]["param_plan"]["model.layers.*.self_attn"]
    assert attention["params"]["q_proj.weight"] == {"tp": "S(0,8,2)"} and "num_key_value_groups" in attention["local_attrs"]
    check(results, name)
    rows = [by_case[name]["shapes"]["model.layers.0.self_attn.q_proj.weight"][0] // 8 for by_case in results]
    assert rows == [4, 3, 4, 3], rows


@pytest.mark.parametrize("name", ["falcon_7", "falcon_7_nda"])
def test_planned_multi_query_falcon_at_tp2(results2: tuple[dict[str, Any], list[dict[str, Any]]], name: str) -> None:
    cases, results = results2
    plan = cases[name][1]["param_plan"]
    attention = plan["transformer.h.*.self_attention"]
    assert attention["params"]["query_key_value.weight"] == {"tp": "B(0,56:S(0,8),8:R,8:R)"}
    assert "summed_reduction" in plan["transformer.h.*"]
    check(results, name)
    rows = [by_case[name]["shapes"]["transformer.h.0.self_attention.query_key_value.weight"][0] // 8 for by_case in results]
    assert rows == [4 + 2, 3 + 2], rows  # 4 and 3 query heads, each rank with the key and the value
    for by_case in results:
        # one all-reduce a layer (the summed attention and MLP) and the embedding's, forward; backward, the shared
        # input's once a layer, lm_head's input, and the key and value rows' gradient summed once a layer
        assert by_case[name]["all_reduces"] == {"forward": 1 + LAYERS, "backward": 1 + 2 * LAYERS}, by_case[name]
