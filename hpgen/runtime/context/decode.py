"""A decode step over the key/value cache split across ``cp``: each rank attends over its own
positions, and the ranks' partial results are merged exactly by log-sum-exp.

A forward that continues a filled cache (a decode step) runs its hidden states whole on
every rank (:class:`~hpgen.runtime.install.context_checks.DecodeReplicates`: every op of
the ``cp`` axis returns its input, so norms, projections and the MLP are replicated).
Only attention differs from one process's, where the cache is split
(:mod:`hpgen.runtime.context.cache`):

- the body's cache is :class:`DecodeCache`: its ``update`` keeps the new tokens placed on
  this rank and returns the keys and values this rank holds;
- the body's attention call goes to :func:`split_cache_attention` (cp's ``context_attention``,
  the function the module's config names under sdpa, hands it a call carrying the step as a
  keyword argument): the queries over the held keys, with the columns of the
  mask transformers built for the whole sequence taken at the held positions (the causal
  mask of those positions where it built none), giving an output and its log-sum-exp;
  one all-gather of both over ``cp`` and :func:`~hpgen.runtime.context.merge.merge_partials`
  make the attention over every position.

The partial attention is computed in float32 with plain tensor ops (any device and dtype;
a decode step has few queries, so nothing quadratic is large).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from hpgen.runtime.context.cache import CacheStandIn, SplitLayer, body_cache, hand_cache, split_layer
from hpgen.runtime.context.merge import merge_partials

__all__ = ["DecodeCache", "DecodeStep", "decode_attention", "split_cache_attention"]

STEP = "hp_cp_decode_step"  # the keyword the body passes on to the attention call


class DecodeStep:
    """What the attention call of one layer's decode step needs: the axis and the layer it keeps."""

    def __init__(self, axis: Any, layer: SplitLayer) -> None:
        self.axis = axis
        self.layer = layer
        self.start = layer.get_seq_length()  # the first new token's position


class DecodeCache(CacheStandIn):
    """Stands in for the attention body's cache in a decode step: ``update`` keeps this rank's new
    tokens in the split layer and returns every key and value this rank holds."""

    def __init__(self, cache: Any, step: DecodeStep) -> None:
        super().__init__(cache)
        self.step = step

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return self.step.layer.add(key_states, value_states)


def decode_attention(module: nn.Module, axis: Any, args: tuple, kwargs: dict, *, routed: bool) -> Any:
    """The attention module's body in a forward the ``cp`` axis runs whole: over the split cache
    with the ranks' partial results merged, or the body as it is (no split cache).

    ``routed``: the body's attention call goes to cp's ``context_attention`` (sdpa), which hands
    a call carrying the :class:`DecodeStep` keyword to :func:`split_cache_attention`. The body's
    signature, cache parameter and ``**kwargs`` are those cp's attention recorded when it was
    installed (``_hp_cp_signature``, ``_hp_cp_cache``, ``_hp_cp_kwargs``)."""
    cache_name, var_kw = module._hp_cp_cache, module._hp_cp_kwargs
    layer_idx = getattr(module, "layer_idx", None)
    if axis.size == 1 or var_kw is None or layer_idx is None:
        return module._forward_impl(*args, **kwargs)
    bound = module._hp_cp_signature.bind(*args, **kwargs)
    arguments = bound.arguments
    extra, cache = body_cache(arguments, cache_name, var_kw)
    layer = None if cache is None else split_layer(cache, layer_idx, axis)
    if layer is None or not layer.get_seq_length():
        return module._forward_impl(*args, **kwargs)
    if not routed:
        raise RuntimeError(
            f"{type(module).__name__}: a cache split over cp is decoded by cp's sdpa attention; this module's attention "
            "implementation is not it (split caches are made under sdpa, transformers' default)"
        )
    step = DecodeStep(axis, layer)
    extra[STEP] = step
    hand_cache(arguments, extra, cache_name, var_kw, DecodeCache(cache, step))
    return module._forward_impl(*bound.args, **bound.kwargs)


def split_cache_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention call of a decode step (from cp's ``context_attention``): this rank's
    partial attention over the keys it holds, merged with the other ranks' by log-sum-exp."""
    step: DecodeStep = kwargs.pop(STEP)
    if dropout:
        raise RuntimeError("context parallelism: a decode step over a split cache runs without attention dropout")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise RuntimeError(f"context parallelism: a split cache's decode attention does not cover {name!r}")
    if kwargs.get("sliding_window") is not None:
        raise RuntimeError("context parallelism: a split cache's decode attention does not cover sliding windows")
    out, lse = partial_attention(query, key, value, _held_mask(attention_mask, step, query.size(2)), scaling)
    axis = step.axis
    mine = torch.cat([out, lse.unsqueeze(-1)], dim=-1).contiguous()  # one gather for both
    every = mine.new_empty((axis.size, *mine.shape))
    axis._gather_into(every, mine)
    merged, _ = merge_partials(every[..., :-1], every[..., -1])
    return merged.to(query.dtype).transpose(1, 2).contiguous(), None


def _held_mask(mask: Tensor | None, step: DecodeStep, m: int) -> Tensor:
    """The mask's columns at this rank's held positions (boolean: True attends, or additive float)."""
    positions = step.layer.positions
    if mask is None:  # transformers left causality to sdpa: the causal mask of the held positions
        queries = torch.arange(step.start, step.start + m, device=positions.device)
        return (positions[None, :] <= queries[:, None])[None, None]
    if mask.dim() != 4:
        raise ValueError(f"context parallelism needs the 4-D attention mask transformers builds, got {mask.dim()}-D")
    return mask.index_select(-1, positions.to(mask.device))


def partial_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: float | None
) -> tuple[Tensor, Tensor]:
    """Softmax attention of ``query`` ``[b, h, m, d]`` over ``key``/``value`` ``[b, kv_h, k, d]``
    (query head ``i`` reads key head ``i // (h // kv_h)``) in float32, with ``mask``
    ``[b or 1, 1, m, k]`` (boolean: True attends; or additive): the output and the log-sum-exp
    of each query's scores (``-inf`` and a zero output where the mask leaves it no key).

    Grouped query heads are folded into the query rows of their key head, so the keys and
    values (the cache) are read as they are, never repeated per head.
    """
    b, h, m, d = query.shape
    kv_heads, k = key.size(1), key.size(2)
    groups = h // kv_heads
    scale = d**-0.5 if scaling is None else scaling
    rows = query.float().reshape(b, kv_heads, groups * m, d)
    scores = (torch.matmul(rows, key.float().transpose(-1, -2)) * scale).view(b, kv_heads, groups, m, k)
    # a mask of one head row for all ([b, 1, m, k]), or one per query head
    mask = mask.unsqueeze(2) if mask.size(1) == 1 else mask.reshape(mask.size(0), kv_heads, groups, m, k)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    if k == 0:
        lse = scores.new_full((b, h, m), float("-inf"))
        return scores.new_zeros((b, h, m, value.size(-1))), lse
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights.view(b, kv_heads, groups * m, k), value.float()).view(b, h, m, -1)
    out = out / total.view(b, h, m, 1).clamp_min(torch.finfo(torch.float32).tiny)
    return out, (top + torch.log(total)).view(b, h, m)
