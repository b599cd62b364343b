"""The boundaries transformers' styles imply (:mod:`hpgen.planner.translate.style_blocks`)."""

from __future__ import annotations

from tests.planner.plan_helpers import entry, translated


def test_identity_experts_become_partial_inside_the_experts_sum() -> None:
    # transformers' moe_identity_expert: LongCat-Flash's zero-compute experts (nn.Identity) return the same
    # value on every rank, inside an experts module whose output is all-reduced: R -> P(sum)
    model, plan = translated("longcat_flash")
    if not any(name.endswith(".identity_expert") for name, _ in model.named_modules()):
        # transformers >= 5.25: the zero-compute experts are added outside the experts module, after its sum
        assert entry(plan, "model.layers.*.mlp.experts")["out_src"] == {"output": {"tp": "P(sum)"}}
        return
    identity = entry(plan, "model.layers.*.mlp.experts.identity_expert")
    assert identity["out_src"] == {"output": {"tp": "R"}} and identity["out_dst"] == {"output": {"tp": "P(sum)"}}
    assert entry(plan, "model.layers.*.mlp.experts")["out_src"] == {"output": {"tp": "P(sum)"}}
