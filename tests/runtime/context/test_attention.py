"""cp attention (:func:`hpgen.runtime.context.attention.context_attention`) on 2 gloo ranks against transformers' sdpa.

Each rank calls the attention function with its head-tail rows of the queries, keys and values
and the layout as the keyword argument; its outputs and the gradients of the whole tensors
(each rank's part, summed over the ranks) must be those of transformers' sdpa on the whole
sequence: causal without a mask, a padding mask, packed documents, a 4-D mask that lets queries
see later keys, fewer key/value heads, bfloat16. Forms the blocks do not compute go to the
gathered fallback: a learned ``position_bias`` gets its gradient, and attention dropout draws
its mask as sdpa does over this rank's rows. The blocks' plain-math form is checked against
torch's CPU kernel in one process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.support.dist import run_distributed
from tests.support.models import tolerance

B, H, KV, N, D = 2, 4, 2, 11, 8  # 11 tokens: uneven head-tail chunks (3, 3, 3, 2); 2 query heads per key/value head


def _masks() -> dict[str, torch.Tensor | None]:
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    padded = causal[None, None].repeat(B, 1, 1, 1)
    padded[0, :, :, :4] = False  # a left-padded row: its first 4 keys hidden (its first queries see nothing)
    starts = torch.tensor([0] * 5 + [5] * 4 + [9] * 2)
    packed = causal & (starts[:, None] == starts[None, :])  # three documents, each causal
    ahead = causal.clone()
    ahead[:3, 7:] = True  # the first queries also see some late keys: the block after the chunk counts
    return {
        "causal": None,
        "padded": padded,
        "packed": packed[None, None].expand(B, 1, N, N),
        "4-D ahead": ahead[None, None].expand(B, 1, N, N),
    }


def _attention(rank: int, world_size: int) -> dict[str, tuple[float, float]]:
    import torch.distributed as dist
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hpgen.runtime.context.sequence import KEYWORD, CutSequence
    from hpgen.runtime.context.attention import context_attention
    from hpgen.runtime.forward.context_axis import ContextAxis

    ax = ContextAxis(dist.group.WORLD, "cp")
    layout = ax.layout(N, torch.device("cpu"))
    sequence = {KEYWORD: CutSequence(ax, layout)}
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = H // KV, True
    found = {}

    def bound(reference: torch.Tensor) -> float:
        # bfloat16 rounds each block's output and the merge once more: 4 rounding units of the scale
        return tolerance(reference) if reference.dtype != torch.bfloat16 else 4 * 2**-8 * reference.abs().max().item()

    def compare(label: str, tensors: list[torch.Tensor], mask: Any, bias: bool = False, **kwargs: Any) -> None:
        generator = torch.Generator().manual_seed(1)
        w = torch.randn(B, N, H, D, generator=generator).to(tensors[0].dtype)
        whole = [t.clone().requires_grad_() for t in tensors]
        extra = dict(position_bias=whole[3]) if bias else {}
        out, _ = sdpa_attention_forward(module, *whole[:3], mask, **extra, **kwargs)
        (out.float() * w.float()).sum().backward()
        mine = [t.clone().requires_grad_() for t in tensors]
        local = [t.index_select(2, layout.local) for t in mine]  # this rank's rows (of the bias: its query rows)
        extra = dict(position_bias=local[3]) if bias else {}
        got, _ = context_attention(module, *local[:3], mask, **extra, **kwargs, **sequence)
        (got.float() * w.index_select(1, layout.local).float()).sum().backward()
        expected = out.index_select(1, layout.local)
        found[f"{label} output"] = ((got.float() - expected.float()).abs().max().item(), bound(expected))
        for name, ref, t in zip(("query", "key", "value", "position_bias"), whole, mine):
            if t.grad is None:
                found[f"{label} {name}"] = (float("inf"), 0.0)
                continue
            grad = t.grad.float()
            dist.all_reduce(grad)  # each rank's part of the whole tensor's gradient
            found[f"{label} {name}"] = ((grad - ref.grad.float()).abs().max().item(), bound(ref.grad))

    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(B, heads, N, D, generator=generator) for heads in (H, KV, KV)]
    for label, mask in _masks().items():
        compare(label, tensors, mask)
    compare("bfloat16", [t.bfloat16() for t in tensors], None)
    compare("bfloat16 padded", [t.bfloat16() for t in tensors], _masks()["padded"])
    bias = torch.randn(1, H, N, N, generator=generator)  # learned: the fallback's autograd gives its gradient
    equal_heads = [torch.randn(B, H, N, D, generator=generator) for _ in range(3)]
    module.num_key_value_groups = 1
    compare("position_bias", [*equal_heads, bias], _masks()["packed"], bias=True)
    module.num_key_value_groups = H // KV

    # dropout: the blocks draw none, so it runs sdpa over this rank's rows with the same draws
    query = tensors[0].index_select(2, layout.local)
    key, value = (t.index_select(2, layout.local) for t in tensors[1:])
    torch.manual_seed(5 + rank)
    got, _ = context_attention(module, query, key, value, None, dropout=0.5, **sequence)
    rows = (torch.arange(N)[None, :] <= layout.local[:, None])[None, None]
    torch.manual_seed(5 + rank)
    expected, _ = sdpa_attention_forward(module, query, *tensors[1:], rows, dropout=0.5)
    found["dropout as sdpa draws it"] = ((got - expected).abs().max().item(), 0.0)
    plain, _ = context_attention(module, query, key, value, None, **sequence)
    found["dropout drops something"] = (float(torch.equal(got, plain)), 0.0)
    return found


def test_context_attention_matches_sdpa_on_the_whole_sequence() -> None:
    for rank, found in enumerate(run_distributed(_attention, world_size=2, timeout=120)):
        for name, (err, tol) in found.items():
            assert err <= tol, f"rank {rank}: {name} {err:.2e} > {tol:.2e}"
        assert {"causal key", "padded value", "4-D ahead query", "bfloat16 key", "position_bias position_bias"} <= set(found)


def test_the_blocks_plain_math_matches_torchs_cpu_kernel() -> None:
    from hpgen.runtime.context.blockwise import math_block, math_block_backward, run_block, run_block_backward
    from hpgen.runtime.context.merge import merge_partials

    generator = torch.Generator().manual_seed(2)
    query = torch.randn(2, 3, 5, 8, generator=generator)
    key, value = (torch.randn(2, 3, 12, 8, generator=generator) for _ in range(2))
    mask = torch.rand(2, 1, 5, 12, generator=generator) > 0.4
    mask[0, :, 1] = False  # a query that sees no key
    blocks = ((0, 7, False, mask[..., :7]), (7, 5, False, mask[..., 7:]), (7, 5, True, None))
    for first, count, causal, part in blocks:
        k, v = key[:, :, first : first + count], value[:, :, first : first + count]
        (out, lse), (want, want_lse) = math_block(query, k, v, part, causal, 0.3), run_block(query, k, v, part, causal, 0.3)
        assert (out - want).abs().max() <= 1e-5 and torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        assert (lse.nan_to_num(neginf=0) - want_lse.nan_to_num(neginf=0)).abs().max() <= 1e-5
    # the blocks of the masked rows merged, and each block's backward from the merged output
    parts = [run_block(query, key[:, :, f : f + c], value[:, :, f : f + c], p, z, 0.3) for f, c, z, p in blocks[:2]]
    out, lse = merge_partials([o for o, _ in parts], [l for _, l in parts])
    whole = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3)
    assert (out - whole).abs().max() <= 1e-5
    grad = torch.randn(out.shape, generator=generator)
    for first, count, causal, part in blocks[:2]:
        k, v = key[:, :, first : first + count], value[:, :, first : first + count]
        plain = math_block_backward(grad, query, k, v, out, lse, part, causal, 0.3)
        fused = run_block_backward(grad, query, k, v, out, lse, part, causal, 0.3)
        for a, b in zip(plain, fused):
            assert (a - b).abs().max() <= 1e-5 and torch.isfinite(a).all()
