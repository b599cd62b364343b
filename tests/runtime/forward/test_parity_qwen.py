"""What is particular to the Qwen rows of the parity table (``parity_table.PARITY``)."""

from __future__ import annotations

from tests.support.parity_table import hpgen_plan


def test_inner_wrapper_wraps_the_local_compute(parity: list[dict]) -> None:
    for by_case in parity:
        assert by_case["qwen3_moe_wrapped"].region_calls == ["experts", "experts"]  # one per MoE layer
        assert by_case["qwen3_moe_tp_ep"].region_calls == []


def test_hpgen_plans_cover_both_expert_layouts() -> None:
    # the two plans differ where it matters: the experts' intermediate dim vs the expert dim
    tp = hpgen_plan("qwen3_moe", tp=2)()["param_plan"]["model.layers.*.mlp.experts"]["params"]
    ep = hpgen_plan("qwen3_moe", tp=2, ep=2)()["param_plan"]["model.layers.*.mlp.experts"]["params"]
    assert tp["down_proj"] == {"tp": "S(2)"} and ep["down_proj"] == {"tp": "S(0)"}
