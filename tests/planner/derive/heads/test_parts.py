"""Heads split into parts working together, differential attention (:mod:`hpgen.planner.derive.heads.parts`)."""

from __future__ import annotations

from tests.planner.plan_helpers import derived, entry


def test_differential_attention_keeps_each_pair_of_heads_on_one_rank() -> None:
    # DiffLlama works head i with head i + H/2 (chunk(2) over the heads) and the value heads in halves:
    # each rank takes its chunk of both halves, SS(0,2); the halves combine element by element, so the
    # row projection's input holds a rank's pairs contiguously, S(1)
    plan = derived("diffllama")
    attention = entry(plan, "model.layers.*.self_attn")
    assert attention["params"] == {
        "q_proj.weight": {"tp": "SS(0,2)"},
        "k_proj.weight": {"tp": "RS(0,2)"},  # one key/value head per half: every rank needs both
        "v_proj.weight": {"tp": "RS(0,2)"},
        "o_proj.weight": {"tp": "S(1)"},
    }
    assert attention["tp_divide_attrs"] == ["num_key_value_groups"]  # 2 query heads per key/value head -> 1
    assert attention["grad_reduce_params"] == ["lambda_k1", "lambda_k2", "lambda_q1", "lambda_q2"]
    assert "split into 2 parts" in plan["comments"]["sharded"]["model.layers.*.self_attn"]
    # four key/value heads, two per half: a strided cut of them too, and the groups stay as they are
    grouped = entry(derived("diffllama_grouped"), "model.layers.*.self_attn")
    assert {name: p["tp"] for name, p in grouped["params"].items()} == {
        "q_proj.weight": "SS(0,2)", "k_proj.weight": "SS(0,2)", "v_proj.weight": "SS(0,2)", "o_proj.weight": "S(1)"
    }
    assert "tp_divide_attrs" not in grouped


def test_differential_attention_whose_halves_do_not_divide_stays_replicated() -> None:
    # on 4 ranks the 2 key/value heads of each half neither divide nor are one per half
    plan = derived("diffllama_grouped", tp=4)
    assert "model.layers.*.self_attn" not in plan["param_plan"]
    reason = plan["comments"]["replicated"]["model.layers.*.self_attn.k_proj"]
    assert "2 per part neither divide over --tp 4" in reason, reason
    assert entry(plan, "model.layers.*.mlp")["params"]["down_proj.weight"] == {"tp": "S(1)"}
