"""Blocks of transformers' plan the source contradicts fall back (:mod:`hpgen.planner.passes.crosscheck`)."""

from __future__ import annotations

from tests.support.derived_configs import tiny
from tests.planner.plan_helpers import translated


def test_a_block_the_source_contradicts_falls_back_to_replicated() -> None:
    # a block of transformers' plan that shards the module needing a sharded value whole is dropped,
    # the group staying replicated as the derivation leaves it; MLA plans (deepseek_v2) keep their
    # attention: what needs a value whole there is kv_a_layernorm, which transformers leaves replicated too
    from hpgen.planner.derive.placed import Derivation
    from hpgen.planner.passes.crosscheck import drop_contradicted

    from hpgen.core.placement import Placement
    from hpgen.core.plan_entries import Layout
    from hpgen.planner.translate.draft import DraftEntry, DraftPlan

    def layout(text: str) -> Layout:
        return Layout.same(("tp",), Placement.parse(text))

    plan = DraftPlan(
        "M",
        ("tp",),
        {
            "layers.*.attn": DraftEntry(params={"q.weight": layout("S(0)"), "mix.weight": layout("S(1)")}),
            "layers.*.mlp": DraftEntry(params={"up.weight": layout("S(0)")}),
        },
    )
    derivation = Derivation()
    derivation.note("layers.0.attn.q", False, "the output of q also reaches mix", needs_whole="layers.0.attn.mix")
    kept = drop_contradicted(plan, derivation)
    assert list(kept.entries) == ["layers.*.mlp"]
    assert "kept replicated" in kept.comments["replaced"]["layers.*.attn"]
    _, deepseek = translated("deepseek_v2")
    assert "model.layers.*.self_attn" in deepseek["param_plan"]
    assert "replaced" not in deepseek["comments"]


def test_statistics_over_sharded_features_keep_those_layers_replicated() -> None:
    # Gemma3n's MLP thresholds gate_proj's output by its features' mean and std where activation_sparsity
    # > 0 (the first two of the tiny config's four layers): those MLPs stay replicated, the others shard
    _, plan = translated("gemma3n_text")
    assert "model.layers.*.mlp" not in plan["param_plan"]
    assert {"model.layers.2.mlp", "model.layers.3.mlp"} <= set(plan["param_plan"])
    assert {"model.layers.0.mlp", "model.layers.1.mlp"} <= set(plan["comments"]["replaced"])
    assert "_gaussian_topk" in plan["comments"]["replaced"]["model.layers.0.mlp"]
