"""Starcoder2 with sequence-parallel norms declared on ``nn.LayerNorm``, a class outside the file.

A norm on a sequence-sharded residual stream computes on each rank's tokens only, so its
parameters' gradients are partial: the plan declares the layout its input arrives in
(``S(1)`` in and in the body) and lists ``weight``/``bias`` in ``grad_reduce_params``.
Such a contract moves nothing, so ``hpgen lower`` leaves ``nn.LayerNorm`` alone (it is not
in the file and needs no rewrite) and ``parallelize`` installs the gradient reductions.
Parity against the unsharded model on 2 gloo ranks: logits, every gradient, greedy tokens.
"""

from __future__ import annotations

import copy

import pytest

from tests.dist import run_distributed
from tests.runtime.models import (
    Case,
    check_generation,
    check_gradients,
    check_logits,
    lower_family,
    make_config,
    run_cases,
)

NORMS = ("input_layernorm", "post_attention_layernorm")


def norm_entries_plan() -> dict:
    """``hpgen plan starcoder2 --tp 2 --sp`` for the tiny config, with the norms' gradient
    reductions declared on the norms themselves instead of on the decoder layers."""
    from hpgen.tp_plan import meta_model, plan_for_model

    plan = copy.deepcopy(plan_for_model(meta_model(make_config("starcoder2")), tp=2, sp=True))
    for key, entry in plan["param_plan"].items():
        if key.startswith("model.layers.") and key.count(".") == 2:
            assert set(entry.pop("grad_reduce_params")) == {f"{n}.{p}" for n in NORMS for p in ("weight", "bias")}
    for norm in NORMS:
        plan["param_plan"][f"model.layers.*.{norm}"] = {
            "in_src": {"input": {"tp": "S(1)"}},
            "in_dst": {"input": {"tp": "S(1)"}},
            "params": {"weight": {"tp": "R"}, "bias": {"tp": "R"}},
            "grad_reduce_params": ["weight", "bias"],
        }
    return plan


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = tmp_path_factory.mktemp("starcoder2")
    plan = norm_entries_plan()
    generated = lower_family("starcoder2", plan, directory)
    return run_distributed(run_cases, [Case("sp_norms", "starcoder2", str(generated), plan)], timeout=300)


def test_the_norm_class_is_left_alone_and_explained(tmp_path: pytest.TempPathFactory) -> None:
    from hpgen.explain import explain
    from hpgen.lower import analyze
    from hpgen.plan import plan_from_dict
    from tests.runtime.models import FAMILIES

    source = FAMILIES["starcoder2"].source()
    report = explain(analyze(source.read_text(), plan_from_dict(norm_entries_plan()), source_name=source.name))
    norms = [record for record in report["wrapped"] if record["fqn"].endswith("layernorm")]
    assert [record["handled_by"] for record in norms] == ["identity", "identity"]
    assert all("all-reduces the gradients of" in r["runs"] and "weight" in r["runs"] and "bias" in r["runs"] for r in norms)


def test_logits(results: list[dict]) -> None:
    check_logits(results, "sp_norms")


def test_gradients(results: list[dict]) -> None:
    check_gradients(results, "sp_norms")


def test_greedy_generation(results: list[dict]) -> None:
    check_generation(results, "sp_norms")


def test_the_residual_stream_is_sequence_sharded(results: list[dict]) -> None:
    assert [by_case["sp_norms"].residual_len for by_case in results] == [4, 3]
