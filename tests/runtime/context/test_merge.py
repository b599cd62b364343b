"""``merge_partials`` and ``partial_attention``: attention over split keys merged by log-sum-exp equals attention over all."""

from __future__ import annotations

import torch

from hpgen.runtime.context.decode import partial_attention
from hpgen.runtime.context.merge import merge_partials


def test_parts_merged_equal_attention_over_every_key() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    allowed = torch.rand(2, 1, 3, 11) > 0.3
    allowed[..., 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    parts = [torch.tensor([0, 5, 7]), torch.tensor([1, 2, 3, 4]), torch.tensor([6, 8, 9, 10])]
    outs, lses = zip(*(partial_attention(q, k[:, :, p], v[:, :, p], allowed[..., p], None) for p in parts), strict=True)
    got, lse = merge_partials(outs, lses)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 8**-0.5
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(lse, scores.masked_fill(~allowed, float("-inf")).logsumexp(-1), atol=1e-5)


def test_a_part_with_every_key_masked_weighs_nothing() -> None:
    out = torch.tensor([[[1.0, 2.0]], [[5.0, 7.0]]])
    lse = torch.tensor([[0.5], [float("-inf")]])
    merged, total = merge_partials(out, lse)
    assert torch.equal(merged, out[0]) and torch.equal(total, lse[0])
    nothing, none = merge_partials(out, torch.full((2, 1), float("-inf")))
    assert torch.equal(nothing, torch.zeros(1, 2)) and none.item() == float("-inf")


def test_float_masks_add_and_an_empty_part_is_minus_infinity() -> None:
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    additive = torch.zeros(1, 1, 1, 5)
    additive[..., 3:] = torch.finfo(torch.float32).min
    out, lse = partial_attention(q, k, v, additive, 0.5)
    want, want_lse = partial_attention(q, k[:, :, :3], v[:, :, :3], torch.ones(1, 1, 1, 3, dtype=torch.bool), 0.5)
    assert torch.allclose(out, want) and torch.allclose(lse, want_lse)
    empty, minus = partial_attention(q, k[:, :, :0], v[:, :, :0], torch.ones(1, 1, 1, 0, dtype=torch.bool), 0.5)
    assert empty.shape == (1, 2, 1, 4) and not empty.any() and torch.isinf(minus).all()
