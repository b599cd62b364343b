"""What pipeline stages do not cover, refused by name on every rank before anything changes."""

from __future__ import annotations

from tests.runtime.pipeline.test_pipeline_parity import _staged_plan
from tests.support.dist import run_distributed
from tests.support.pipeline_runs import refusals


def _three_stages(plan):
    plan["pipeline"]["stages"] = [["model.embed_tokens", "model.layers.0"], ["model.layers.1-2"], ["model.layers.3", "model.norm", "lm_head"]]


def _unknown_module(plan):
    plan["pipeline"]["stages"][1].append("model.final_norm")


def _layer_left_out(plan):
    plan["pipeline"]["stages"][0] = ["model.embed_tokens", "model.layers.0"]
    plan["pipeline"]["stages"][1] = ["model.layers.2-3", "model.norm", "lm_head"]


def _norm_left_out(plan):
    plan["pipeline"]["stages"][1] = [name for name in plan["pipeline"]["stages"][1] if name != "model.norm"]


def _with_cp(plan):
    plan["mesh_dim_names"] = ["pp", "cp"]


CASES = {
    "three stages on two ranks": _three_stages,
    "unknown module": _unknown_module,
    "layer left out": _layer_left_out,
    "norm left out": _norm_left_out,
    "cp": _with_cp,
}

EXPECTED = {
    "three stages on two ranks": "the plan has 3 pipeline stages for 2 ranks on axis 'pp'",
    "unknown module": "pipeline stages name 'model.final_norm', not modules of LlamaForCausalLM",
    "layer left out": "pipeline stages leave model.layers.1 on no stage",
    "norm left out": "model.norm holds parameters but no pipeline stage names it",
    "cp": "pipeline stages with context parallelism (cp) are not covered yet",
    "uneven microbatches": "a batch of 4 does not cut into 3 equal microbatches",
    "unknown schedule": "Zigzag",
    "interleaved on one stage a rank": "schedule 'Interleaved1F1B' runs several stages a rank; this plan has 2 stages on 2 ranks",
    "not staged": "the model has no pipeline stages",
}


def test_refusals_name_what_is_not_covered():
    plan = _staged_plan("llama", dict(num_hidden_layers=4), 2)
    found = run_distributed(refusals, plan, CASES, timeout=240)
    assert found[0] == found[1]  # the same error on every rank
    for name, text in EXPECTED.items():
        assert text in found[0][name] and "Error" in found[0][name], (name, found[0][name])
