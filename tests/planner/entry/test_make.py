"""The choice of planner: transformers' plan kept where it shards the layers, completed from the source where it leaves blocks replicated (:mod:`hpgen.planner.entry.make`)."""

from __future__ import annotations

from tests.support.derived_configs import tiny


def test_transformers_plan_is_kept_where_it_shards_the_layers() -> None:
    from hpgen.planner.entry.make import plan_source
    from hpgen.planner.model.load import meta_model

    neox = meta_model(tiny("gpt_neox"))
    assert plan_source(neox) == "transformers' plan"
    assert plan_source(neox, from_source=True) == "derived from the source"
    assert plan_source(meta_model(tiny("gpt2"))) == "derived from the source"


def test_transformers_plan_is_completed_where_it_leaves_the_attention_replicated() -> None:
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.translate.translator import translated_plan

    model = meta_model(tiny("flint"))
    plan = plan_model(model, tp=2, name="flint")
    translated = translated_plan(model, tp=2, name="flint")
    assert "model.layers.*.self_attn" not in translated["param_plan"]  # transformers shards the MLP only
    for key, entry in translated["param_plan"].items():
        assert plan["param_plan"][key] == entry  # kept as transformers wrote it
    attention = plan["param_plan"]["model.layers.*.self_attn"]
    assert attention["params"]["q_proj.weight"] == {"tp": "S(0)"} and attention["params"]["o_proj.weight"] == {
        "tp": "S(1)"
    }
    assert plan["comments"]["plan_source"] == "transformers' plan"
    assert list(plan["comments"]["completed_from_source"]) == ["model.layers.*.self_attn"]
    # --sp keeps transformers' plan alone: the attention only gathers and splits the sequence
    with_sp = plan_model(model, tp=2, sp=True, name="flint")
    assert "completed_from_source" not in with_sp["comments"]
    assert "params" not in with_sp["param_plan"]["model.layers.*.self_attn"]
