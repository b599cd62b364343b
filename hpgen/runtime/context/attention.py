"""Context parallelism's attention: the region function of attention modules on a ``cp`` axis.

Plans written by ``hpgen plan --cp N`` cut the sequence at the first decoder layer and the
rotary embedding's output (``R -> S(1)`` on ``cp``, the head-tail layout of
:mod:`hpgen.runtime.forward.context_axis`) and gather it at the final norm's output. In
between, each rank computes its own tokens; only attention mixes positions, so it needs
every rank's keys and values. ``gathered_kv_attention`` runs the attention module's own
body; the sequence's layout reaches it as a keyword argument of the call
(:mod:`hpgen.runtime.context.sequence`: the model passes it to every decoder layer, so a
layer recomputed under activation checkpointing gets it with its other inputs).

- sdpa (transformers' default): the module reads its config through :class:`AttentionConfig`,
  whose ``_attn_implementation`` names :func:`context_attention` (one entry of transformers'
  ``AttentionInterface``: the body picks its attention function by that name, and this is
  the public way to give it another). The body's ``cache`` argument becomes
  :class:`LocalKVCache`, so the attention call gets this rank's rotated keys and values and
  the layout (the keyword argument), and computes this rank's queries over every rank's keys
  by blocks merged by log-sum-exp (:mod:`hpgen.runtime.context.blockwise`): no attention over
  padding, exact in forward and backward, saving only this rank's share for backward.
- eager: the body's ``cache`` becomes :class:`GatheringCache`, whose ``update`` all-gathers the
  keys and values along the sequence (Llama 3's all-gather form; the gradient of the gather is
  a reduce-scatter), and its ``attention_mask`` becomes this rank's query rows of the
  unsharded model's mask (the causal mask of its positions where there is none); the body's
  eager attention then runs this rank's queries over all keys.

transformers builds the mask for the whole sequence before the first decoder layer, so
padding, packed documents by ``position_ids`` and a user's 4-D mask are all in it. A forward
that continues a filled cache (a decode step) runs replicated on every rank
(:meth:`~hpgen.runtime.forward.context_axis.ContextAxis.replicate`), its attention over the
cache split across ranks (:mod:`hpgen.runtime.context.decode`). Either stand-in puts this
rank's own keys and values into the caller's cache, if any (:mod:`hpgen.runtime.context.cache`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from hpgen.runtime.context.blockwise import BlockwiseAttention
from hpgen.runtime.context.cache import CacheStandIn, body_cache, hand_cache, keep_prefill
from hpgen.runtime.context.decode import STEP, decode_attention, split_cache_attention
from hpgen.runtime.context.sequence import KEYWORD

__all__ = ["AttentionConfig", "GatheringCache", "LocalKVCache", "context_attention", "gathered_kv_attention"]

CONTEXT_ATTENTION = "hpgen_cp_attention"  # context_attention's name in transformers' AttentionInterface

_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")


class GatheringCache(CacheStandIn):
    """Stands in for the attention body's cache (eager attention): ``update`` gathers the keys and
    values of every rank along the sequence (dim 2) and updates the caller's ``cache``, if any,
    with them (a whole cache: the split one needs :func:`context_attention`'s decode step)."""

    def __init__(self, axis: Any, cache: Any, layout: Any) -> None:
        super().__init__(cache)
        self.axis = axis
        self.layout = layout  # the sequence this forward cut (its keys and values are this rank's share)

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        n = self.layout.n
        gathered = self.axis.all_gather(key_states, dim=2, total=n), self.axis.all_gather(value_states, dim=2, total=n)
        if self.cache is None:
            return gathered
        # the whole keys and values: a decode step's split-cache attention is sdpa's (context_attention), so
        # under eager attention the cache keeps every position and decoding runs replicated
        return self.cache.update(*gathered, *args, **kwargs)


class LocalKVCache(CacheStandIn):
    """Stands in for the attention body's cache under sdpa: ``update`` returns this rank's keys
    and values as they are (:func:`context_attention` gathers them), after putting them into the
    caller's cache (:func:`~hpgen.runtime.context.cache.keep_prefill`; a cache that keeps every
    position gets every rank's, gathered outside autograd)."""

    def __init__(self, axis: Any, cache: Any, n: int) -> None:
        super().__init__(cache)
        self.axis = axis
        self.n = n

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        def gathered() -> tuple[Tensor, Tensor]:  # only a cache that keeps every position asks (alike on every rank)
            with torch.no_grad():
                return (
                    self.axis.all_gather(key_states, dim=2, total=self.n),
                    self.axis.all_gather(value_states, dim=2, total=self.n),
                )

        layout = self.axis.layout(self.n, key_states.device)
        keep_prefill(self.cache, key_states, value_states, layout, self.axis, gathered, args, kwargs)
        return key_states, value_states


def _check_mask(mask: Tensor, layout: Any) -> None:
    if mask.dim() != 4:
        raise ValueError(f"context parallelism needs the 4-D attention mask transformers builds, got {mask.dim()}-D")
    if mask.size(-2) not in (1, layout.n):
        raise ValueError(
            f"context parallelism: the attention mask has {mask.size(-2)} query rows for a sequence of {layout.n}"
        )


def _query_rows(mask: Tensor | None, layout: Any, dtype: torch.dtype, eager: bool) -> Tensor:
    """This rank's rows of the whole sequence's mask; the causal mask of its positions if there is none."""
    if mask is not None:
        _check_mask(mask, layout)
        if mask.size(-2) == 1:  # one row for every query
            return mask
        return mask.index_select(-2, layout.local)
    keys = torch.arange(layout.n, device=layout.local.device)
    allowed = (keys[None, :] <= layout.local[:, None])[None, None]
    if not eager:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


class AttentionConfig:
    """An attention module's ``config``: the model's own, read and written through, except that
    where it names sdpa, ``_attn_implementation`` names :func:`context_attention` (registered in
    transformers' ``AttentionInterface`` as ``CONTEXT_ATTENTION``), which is sdpa with the layout
    of a cut sequence, or a decode step's attention over the split cache: what the call's keyword
    arguments carry decides, nothing is set on the config per call."""

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_hp_config", config)

    @property
    def _attn_implementation(self) -> Any:
        implementation = self._hp_config._attn_implementation
        return CONTEXT_ATTENTION if implementation == "sdpa" else implementation

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_hp_config"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_hp_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._hp_config, name, value)


def context_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """sdpa of this rank's queries over every rank's keys (an ``AttentionInterface`` function).

    ``key`` and ``value`` are this rank's; the layout comes as the keyword argument
    ``hpgen_cp_sequence`` (without it, as outside a cut forward, this is transformers' sdpa).
    Causal or masked attention without dropout runs :class:`~hpgen.runtime.context.blockwise.BlockwiseAttention`.
    What that form cannot do exactly falls back to the whole keys and values gathered under
    autograd and sdpa over this rank's mask rows: attention dropout (the blocks' kernel draws
    none; sdpa draws its mask over this rank's rows), a ``position_bias`` or ``softcap``, and a
    forward traced by ``torch.compile`` (the blocks' Function calls collectives inside).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if STEP in kwargs:  # a decode step over the cache split across cp
        return split_cache_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    sequence = kwargs.pop(KEYWORD, None)
    if sequence is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    axis, layout = sequence.axis, sequence.layout
    if attention_mask is not None:
        _check_mask(attention_mask, layout)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if plain and not dropout and (causal or attention_mask is not None) and not torch.compiler.is_compiling():
        scale = scaling if scaling is not None else query.size(-1) ** -0.5
        groups = query.size(1) // key.size(1)
        return BlockwiseAttention.apply(query, key, value, attention_mask, axis, layout, scale, groups), None
    keys = axis.all_gather(key, 2, total=layout.n)
    values = axis.all_gather(value, 2, total=layout.n)
    rows = attention_mask if attention_mask is None and not causal else _query_rows(attention_mask, layout, query.dtype, False)
    return sdpa_attention_forward(
        module, query, keys, values, rows, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def gathered_kv_attention(module: nn.Module, *args: Any, axis: str = "cp", **kwargs: Any) -> Any:
    """The attention module's body with every rank's keys and values and this rank's queries.

    Bound as ``__hp_compute__`` of attention modules by an injection
    (``{"_target_": "hpgen.runtime.context_attention.gathered_kv_attention", "axis": "cp"}``).
    The sequence's layout is the keyword argument ``hpgen_cp_sequence`` the model passes down.
    """
    ax = getattr(module, f"_hp_{axis}")
    sequence = kwargs.pop(KEYWORD, None)
    if not ax.active:  # one rank, or a decode step: over the split cache if there is one
        routed = getattr(getattr(module, "config", None), "_attn_implementation", None) == CONTEXT_ATTENTION
        return decode_attention(module, ax, args, kwargs, routed=routed)
    if sequence is None:
        raise RuntimeError(
            f"{type(module).__name__}: context parallelism on {axis!r}: no sequence was cut in this forward "
            "(call the whole model, not the attention module alone)"
        )
    layout = sequence.layout
    bound = module._hp_cp_signature.bind(*args, **kwargs)
    arguments = bound.arguments
    cache_name, var_kw = module._hp_cp_cache, module._hp_cp_kwargs
    extra, cache = body_cache(arguments, cache_name, var_kw)
    config = getattr(module, "config", None)
    blockwise = var_kw is not None and isinstance(config, AttentionConfig)
    blockwise = blockwise and config._attn_implementation == CONTEXT_ATTENTION
    if blockwise:  # the attention call gathers, by blocks; the layout travels with the body's keywords
        stand_in = None if cache is None else LocalKVCache(ax, cache, layout.n)
        extra[KEYWORD] = sequence
    else:
        stand_in = GatheringCache(ax, cache, layout)
        dtype = _first_tensor(args, kwargs).dtype
        eager = getattr(config, "_attn_implementation", "eager") == "eager"
        arguments["attention_mask"] = _query_rows(arguments.get("attention_mask"), layout, dtype, eager)
    hand_cache(arguments, extra, cache_name, var_kw, stand_in)
    return module._forward_impl(*bound.args, **bound.kwargs)


def _first_tensor(args: tuple, kwargs: dict) -> Tensor:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor) and value.is_floating_point():
            return value
    raise ValueError("context parallelism: the attention module was given no hidden states")


def _prepare(module: nn.Module, *, axis: str = "cp") -> None:
    """Record the body's parameters: where the mask and the cache are passed."""
    signature = inspect.signature(module._forward_impl)
    names = list(signature.parameters)
    if "attention_mask" not in names:
        raise ValueError(f"{type(module).__name__}: context parallelism needs an attention_mask argument")
    cache = next((name for name in _CACHE_NAMES if name in names), None)
    var_kw = next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
    if cache is None:
        raise ValueError(f"{type(module).__name__}: context parallelism needs the attention body's cache argument")
    module._hp_cp_signature = signature
    module._hp_cp_cache = cache
    module._hp_cp_kwargs = var_kw
    if hasattr(module, "config") and not isinstance(module.config, AttentionConfig):
        from transformers import AttentionInterface

        AttentionInterface.register(CONTEXT_ATTENTION, context_attention)
        module.config = AttentionConfig(module.config)


gathered_kv_attention.prepare = _prepare  # type: ignore[attr-defined]
