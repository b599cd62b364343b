"""Per-head inputs made outside the attention (ALiBi), cut to each rank's heads (:mod:`hpgen.planner.derive.heads.input_cuts`, :mod:`hpgen.planner.derive.heads.input_dims`)."""

from __future__ import annotations

from typing import Any

from tests.planner.plan_helpers import derived, entry


def test_a_per_head_input_with_its_own_head_dim_is_cut_on_entry() -> None:
    plan = derived("mpt")  # position_bias is [heads, 1, max_seq_len], made once by MptModel
    attn = entry(plan, "transformer.blocks.*.attn")
    assert attn["in_src"]["position_bias"] == {"tp": "R"} and attn["in_dst"]["position_bias"] == {"tp": "S(0)"}
    assert attn["params"]["Wqkv.weight"] == {"tp": "SS(0,3)"} and attn["params"]["out_proj.weight"] == {"tp": "S(1)"}
    assert attn["tp_divide_attrs"] == ["n_heads"]
    assert "position_bias" in plan["comments"]["sharded"]["transformer.blocks.*.attn"]
    assert "injections" not in plan


def test_a_batch_major_per_head_input_is_cut_by_a_region() -> None:
    plan = derived("bloom")  # alibi is [batch * heads, 1, L]: no S placement holds a rank's heads of every batch
    attention = entry(plan, "transformer.h.*.self_attention")
    assert attention["in_src"] == {"alibi": {"tp": "R"}} and attention["in_dst"] == {"alibi": {"tp": "R"}}
    assert attention["tp_divide_attrs"] == ["num_heads"]
    assert plan["injections"] == [
        {
            "match": "transformer.h.*.self_attention",
            "local_compute_fn": {
                "_target_": "hpgen.runtime.local_heads.batch_major_heads",
                "head_inputs": ["alibi"],
                "global_heads": 4,
                "axis": "tp",
            },
        }
    ]
    # the attention adds the residual inside: its projections are the wrapped leaves
    assert entry(plan, "transformer.h.*.self_attention.query_key_value")["params"]["weight"] == {"tp": "S(0)"}
    assert entry(plan, "transformer.h.*.self_attention.dense")["params"]["weight"] == {"tp": "S(1)"}


def test_batch_major_heads_keeps_this_ranks_heads_of_every_batch() -> None:
    import types

    import torch

    from hpgen.runtime.forward.local_heads import batch_major_heads

    class Body(torch.nn.Module):
        def _forward_impl(self, hidden_states: torch.Tensor, alibi: torch.Tensor, mask: Any = None) -> torch.Tensor:
            return alibi

    body = Body()
    alibi = torch.arange(2 * 4 * 3.0).reshape(2 * 4, 1, 3)  # batch 2, heads 4, row b * 4 + h
    for rank in (0, 1):
        body._hp_tp = types.SimpleNamespace(size=2, rank=rank)
        got = batch_major_heads(body, None, alibi, head_inputs=["alibi"], global_heads=4)
        want = alibi.view(2, 4, 1, 3)[:, 2 * rank : 2 * rank + 2].reshape(4, 1, 3)
        assert torch.equal(got, want)
    body._hp_tp = types.SimpleNamespace(size=1, rank=0)  # unparallelized: the body as it is
    assert batch_major_heads(body, None, alibi, head_inputs=["alibi"], global_heads=4) is alibi
