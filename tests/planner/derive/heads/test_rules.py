"""The head rules: which layers work on whole heads (:mod:`hpgen.planner.derive.heads.rules`)."""

from __future__ import annotations




def test_a_weightless_torch_norm_over_whole_heads_works_per_head() -> None:
    import torch.nn as nn

    from hpgen.planner.derive.heads.rules import normalized_heads

    assert normalized_heads(nn.RMSNorm(32, elementwise_affine=False), {16}) == 32  # a pair of heads
    assert normalized_heads(nn.LayerNorm(16, elementwise_affine=False, bias=False), {16}) == 16
    assert normalized_heads(nn.RMSNorm(24, elementwise_affine=False), {16}) is None  # not whole heads
    assert normalized_heads(nn.RMSNorm(32), {16}) is None  # a weight: the per-head rule of q_norm decides

    class OwnNorm(nn.Module):  # its forward might reduce over anything: not taken on trust
        normalized_shape = (32,)

    assert normalized_heads(OwnNorm(), {16}) is None
