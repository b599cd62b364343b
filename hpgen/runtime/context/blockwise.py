"""Causal attention of a rank's head-tail chunks, in blocks merged by their log-sum-exp.

Rank ``r`` of a ``cp`` axis holds chunks ``r`` and ``2·cp−1−r`` of the sequence. Each chunk's
queries attend to the keys before the chunk (one block, every query to every key) and to the
chunk's own keys (one block, causal). Each block returns its output and the log-sum-exp of its
scores per query; the chunk's attention is their sum weighted by ``exp(lse_block − lse)``, where
``lse`` is the log-sum-exp over the blocks: exactly the softmax over all of the chunk's keys.
So a rank computes only the query/key pairs the causal mask keeps (``n²/(2·cp)`` per rank), with
no rows of zeros in front of a chunk and no mask built. With a mask (padding, packed documents, a
user's 4-D mask) the blocks are the keys before, within and after the chunk, each with its slice
of the mask, and a block the mask hides wholly is skipped.

Backward is exact too: each block's gradients come from the attention backward called with the
MERGED output and log-sum-exp (which gives the block its share of the softmax), summed over the
blocks. The keys and values are gathered whole in forward (the all-gather form: each rank holds
one layer's whole keys and values while it runs) and again in backward; what is saved is this
rank's queries, keys, values, output and log-sum-exp, a ``1/cp`` share of the sequence.

On the CPU the blocks run ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward:
torch's fused CPU attention (what ``scaled_dot_product_attention`` runs there), called through the
dispatcher because it is the public op that returns the log-sum-exp and takes it back in backward;
its name is underscored, so every other device and dtype runs :func:`math_block` and
:func:`math_block_backward` (the same formulas in plain tensor ops, tested against it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from hpgen.runtime.context.merge import merge_partials

__all__ = ["BlockwiseAttention", "math_block", "math_block_backward", "run_block", "run_block_backward"]

_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _kernel(query: Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype in _KERNEL_DTYPES


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask (True: attend) as the additive mask the kernel takes; a float mask as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def _visible(mask: Tensor) -> Tensor:
    """Per query row of a mask slice: whether it lets the query see any key."""
    return mask.any(-1) if mask.dtype == torch.bool else (mask != float("-inf")).any(-1)


def math_block(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """One block's attention and log-sum-exp, in float32 tensor ops (``mask`` additive or boolean)."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    scores = _masked(scores, mask, causal)
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - _finite(lse)[..., None])
    return torch.matmul(probs, value.float()).to(query.dtype), lse


def math_block_backward(
    grad: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
    causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's gradients given the merged ``out`` and ``lse`` of its queries (flash attention's backward)."""
    scores = _masked(torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale, mask, causal)
    probs = torch.exp(scores - _finite(lse)[..., None])
    grad = grad.float()
    grad_value = torch.matmul(probs.transpose(-1, -2), grad)
    grad_probs = torch.matmul(grad, value.float().transpose(-1, -2))
    delta = (grad * out.float()).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - delta) * scale
    return torch.matmul(grad_scores, key.float()), torch.matmul(grad_scores.transpose(-1, -2), query.float()), grad_value


def _masked(scores: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    if mask is not None:
        scores = scores + _additive(mask, torch.float32)
    if causal:
        rows, cols = scores.shape[-2:]
        hidden = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _finite(lse: Tensor) -> Tensor:
    """``lse`` with the rows that see no key (``-inf``) at 0, so that their weights are 0, not NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def run_block(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """One block's ``(out, lse)``: torch's fused CPU kernel where it runs, else :func:`math_block`."""
    if not _kernel(query):
        return math_block(query, key, value, mask, causal, scale)
    additive = None if mask is None else _additive(mask, query.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, attn_mask=additive, scale=scale
    )
    if mask is not None:  # the kernel gives a row that sees no key lse 0; the merge needs -inf there
        lse = lse.masked_fill(~_visible(mask).expand_as(lse), float("-inf"))
    return out, lse


def run_block_backward(
    grad: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
    causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's gradients of query, key and value from the merged ``out`` and ``lse``."""
    if not _kernel(query):
        return math_block_backward(grad, query, key, value, out, lse, mask, causal, scale)
    blind = torch.isneginf(lse)  # queries that see no key at all: no gradient, and no NaN from exp(-(-inf))
    grad = grad.masked_fill(blind[..., None], 0)
    additive = None if mask is None else _additive(mask, query.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.contiguous(), query, key, value, out, _finite(lse), 0.0, causal, attn_mask=additive, scale=scale
    )


def _blocks(start: int, length: int, n: int, mask: Tensor | None) -> Iterator[tuple[int, int, bool, Tensor | None]]:
    """``(key start, key count, causal, mask slice)`` of the blocks one chunk's queries attend to."""
    if mask is None:  # causal: the keys before the chunk, all of them; the chunk's own, causally
        if start:
            yield 0, start, False, None
        yield start, length, True, None
        return
    rows = mask if mask.size(-2) == 1 else mask.narrow(-2, start, length)
    for first, count in ((0, start), (start, length), (start + length, n - start - length)):
        if count:
            part = rows.narrow(-1, first, count)
            if _visible(part).any():
                yield first, count, False, part


def _chunks(layout: Any) -> list[tuple[int, int, int]]:
    """``(offset in this rank's tokens, start in the sequence, length)`` of this rank's two chunks."""
    found, offset = [], 0
    for chunk in (layout.rank, 2 * layout.size - 1 - layout.rank):
        start, length = layout.chunks[chunk]
        if length:
            found.append((offset, start, length))
            offset += length
    return found


def _repeat_heads(x: Tensor, groups: int) -> Tensor:
    """Each key/value head repeated for its ``groups`` query heads (transformers' ``repeat_kv``)."""
    if groups == 1:
        return x
    batch, heads, n, dim = x.shape
    return x[:, :, None].expand(batch, heads, groups, n, dim).reshape(batch, heads * groups, n, dim)


class BlockwiseAttention(torch.autograd.Function):
    """This rank's causal attention over the whole sequence's keys, by blocks (the module docstring).

    ``query`` ``[batch, heads, local, dim]`` and ``key``, ``value`` ``[batch, kv_heads, local, dim]``
    are this rank's tokens in the head-tail order; ``mask`` is the whole sequence's 4-D mask or
    ``None`` (causal). Returns ``[batch, local, heads, dim]``, as transformers' attention functions do.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, axis: Any, layout: Any,
        scale: float, groups: int,
    ) -> Tensor:
        with torch.no_grad():
            keys = _repeat_heads(axis.all_gather(key, 2, total=layout.n), groups)
            values = _repeat_heads(axis.all_gather(value, 2, total=layout.n), groups)
        outs, lses = [], []
        for offset, start, length in _chunks(layout):
            rows = query.narrow(2, offset, length)
            parts = [
                run_block(rows, keys.narrow(2, first, count), values.narrow(2, first, count), part, causal, scale)
                for first, count, causal, part in _blocks(start, length, layout.n, mask)
            ]
            if not parts:  # a mask that hides every key from the chunk
                parts = [(rows.new_zeros(rows.shape), rows.new_full(rows.shape[:-1], float("-inf"), dtype=torch.float32))]
            out, lse = merge_partials([o.float() for o, _ in parts], [l for _, l in parts])
            outs.append(out.to(query.dtype))
            lses.append(lse)
        out = torch.cat(outs, 2) if outs else query.new_zeros(query.shape)
        lse = torch.cat(lses, 2) if lses else query.new_zeros(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse, mask)
        ctx.context = (axis, layout, scale, groups)
        return out.transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        query, key, value, out, lse, mask = ctx.saved_tensors
        axis, layout, scale, groups = ctx.context
        grad = grad.transpose(1, 2)
        local_key, local_value = key.detach().requires_grad_(), value.detach().requires_grad_()
        with torch.enable_grad():  # the gathers' own backward (a reduce-scatter) takes the whole gradients home
            gathered = (axis.all_gather(local_key, 2, total=layout.n), axis.all_gather(local_value, 2, total=layout.n))
        keys, values = (_repeat_heads(t.detach(), groups) for t in gathered)
        grad_query = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        grad_keys = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
        grad_values = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
        for offset, start, length in _chunks(layout):
            rows, dout = query.narrow(2, offset, length), grad.narrow(2, offset, length)
            o, l = out.narrow(2, offset, length), lse.narrow(2, offset, length)
            for first, count, causal, part in _blocks(start, length, layout.n, mask):
                dq, dk, dv = run_block_backward(
                    dout, rows, keys.narrow(2, first, count), values.narrow(2, first, count), o, l, part, causal, scale
                )
                grad_query.narrow(2, offset, length).add_(dq)
                grad_keys.narrow(2, first, count).add_(dk)
                grad_values.narrow(2, first, count).add_(dv)
        batch, heads, n, dim = grad_keys.shape
        sums = [g.view(batch, heads // groups, groups, n, dim).sum(2).to(key.dtype) for g in (grad_keys, grad_values)]
        grad_key, grad_value = torch.autograd.grad(gathered, (local_key, local_value), sums)
        return grad_query.to(query.dtype), grad_key, grad_value, None, None, None, None, None
