"""Context parallelism's attention: the region function of attention modules on a ``cp`` axis.

Plans written by ``hpgen plan --cp N`` cut the sequence at the first decoder layer and the
rotary embedding's output (``R -> S(1)`` on ``cp``, the head-tail layout of
:mod:`hpgen.runtime.forward.context_axis`) and gather it at the final norm's output. In
between, each rank computes its own tokens; only attention mixes positions, so it needs
every rank's keys and values. ``gathered_kv_attention`` runs the attention module's own
body with two changes, both made where the body already hands values over:

- its ``cache`` argument becomes :class:`GatheringCache`, whose ``update`` (which the body
  calls with its rotated keys and values) all-gathers them along the sequence, in
  sequence order (Llama 3's all-gather form; the gradient of the gather is a
  reduce-scatter), and puts this rank's own keys and values into the caller's cache, if
  any (:mod:`hpgen.runtime.context.cache`);
- its ``attention_mask`` becomes this rank's query rows of the unsharded model's mask
  (transformers builds it for the whole sequence before the first decoder layer, so
  padding, packed documents by ``position_ids`` and a user's 4-D mask are all in it).
  Where transformers left causality to sdpa's ``is_causal`` (no mask), the body's
  attention call goes to :func:`chunked_causal_sdpa` instead (the module reads its config
  through :class:`AttentionConfig`, which names that function for the call): each of the
  rank's two chunks attends to the keys up to its end with sdpa's ``is_causal``, no mask
  materialized, so nothing quadratic in the sequence is saved for backward. (With eager
  attention, the causal mask of this rank's global positions is built.)

The body's attention implementation (sdpa or eager) then runs this rank's queries over all
keys. A forward that continues a filled cache (a decode step) runs replicated on every
rank (:meth:`~hpgen.runtime.forward.context_axis.ContextAxis.replicate`), its attention
over the cache split across ranks (:mod:`hpgen.runtime.context.decode`).
Under activation checkpointing a layer's body reruns in backward, after the forward ended:
its layout then comes from the ranks' token counts.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from hpgen.runtime.context.cache import keep_prefill
from hpgen.runtime.context.decode import decode_attention

__all__ = ["AttentionConfig", "GatheringCache", "LocalKVCache", "RecomputedAttention", "chunked_causal_sdpa", "gathered_kv_attention", "recomputed_attention"]

CHUNKED_CAUSAL = "hpgen_cp_chunked_causal_sdpa"  # its name in transformers' AttentionInterface
RECOMPUTED = "hpgen_cp_recomputed_attention"

_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past")


class GatheringCache:
    """Stands in for the attention body's cache: ``update`` gathers the keys and values of
    every rank along the sequence (dim 2), after putting this rank's into the caller's ``cache``
    if there is one (:func:`~hpgen.runtime.context.cache.keep_prefill`)."""

    def __init__(self, axis: Any, cache: Any) -> None:
        self.axis = axis
        self.cache = cache

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        gathered = self.axis.all_gather(key_states, dim=2), self.axis.all_gather(value_states, dim=2)
        if self.cache is None:
            return gathered
        # this rank's positions into the cache (or the whole, for caches that keep it: then what it returns)
        layout = self.axis.current or self.axis.held_layout(key_states, 2)
        return keep_prefill(self.cache, key_states, value_states, layout, self.axis, lambda: gathered, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        cache = self.__dict__.get("cache")
        if cache is None:
            raise AttributeError(name)
        return getattr(cache, name)


class LocalKVCache:
    """Stands in for the attention body's cache in a cp training step: ``update`` returns this
    rank's keys and values as they are (:class:`RecomputedAttention` gathers them), after
    putting them into the caller's cache (:mod:`hpgen.runtime.context.cache`)."""

    def __init__(self, axis: Any, cache: Any, module: nn.Module, n: int) -> None:
        self.axis = axis
        self.cache = cache
        self.module = module
        self.n = n

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            key = self.axis.all_gather(key_states, dim=2, total=self.n)
            value = self.axis.all_gather(value_states, dim=2, total=self.n)
        layout = self.axis.layout(self.n, key_states.device)
        keep_prefill(self.cache, key_states, value_states, layout, self.axis, lambda: (key, value), args, kwargs)
        self.module._hp_cp_gathered = (key, value)  # the forward's attention uses them, saves nothing of them
        return key_states, value_states

    def __getattr__(self, name: str) -> Any:
        cache = self.__dict__.get("cache")
        if cache is None:
            raise AttributeError(name)
        return getattr(cache, name)


def _query_rows(mask: Tensor | None, layout: Any, dtype: torch.dtype, eager: bool) -> Tensor:
    """This rank's rows of the whole sequence's mask; the causal mask of its positions if there is none."""
    if mask is not None:
        if mask.dim() != 4:
            raise ValueError(f"context parallelism needs the 4-D attention mask transformers builds, got {mask.dim()}-D")
        if mask.size(-2) == 1:  # one row for every query
            return mask
        if mask.size(-2) != layout.n:
            raise ValueError(
                f"context parallelism: the attention mask has {mask.size(-2)} query rows for a sequence of {layout.n}"
            )
        return mask.index_select(-2, layout.local)
    keys = torch.arange(layout.n, device=layout.local.device)
    allowed = (keys[None, :] <= layout.local[:, None])[None, None]
    if not eager:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


class AttentionConfig:
    """An attention module's ``config``: the model's own, read and written through, except that
    while :func:`gathered_kv_attention` runs its ``_attn_implementation`` names hpgen's
    function for the call (:func:`chunked_causal_sdpa`, or :func:`recomputed_attention`)."""

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_hp_config", config)
        object.__setattr__(self, "_hp_route", None)

    @property
    def _attn_implementation(self) -> Any:
        return self._hp_route or self._hp_config._attn_implementation

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_hp_config"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_hp_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._hp_config, name, value)


def chunked_causal_sdpa(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[Tensor, None]:
    """Causal sdpa of this rank's two chunks of queries over the whole sequence's keys, without a mask.

    A chunk starting at global position ``s`` with ``L`` tokens attends to keys ``[0, s + L)``
    causally, aligned at the end: its queries are put after ``s`` zero rows and run through
    sdpa's ``is_causal`` (a square causal mask, which no kernel materializes), and the zero
    rows' outputs are dropped. Exact; it saves nothing quadratic for backward, at the cost of
    the zero rows' attention work.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = module._hp_cp_layout
    size = layout.size
    pieces = []
    offset = 0
    for chunk in (layout.rank, 2 * size - 1 - layout.rank):
        start, length = layout.chunks[chunk]
        if length == 0:
            continue
        rows = query.narrow(2, offset, length)
        offset += length
        if start:
            rows = torch.cat([rows.new_zeros((*rows.shape[:2], start, rows.shape[3])), rows], dim=2)
        out, _ = sdpa_attention_forward(
            module, rows, key.narrow(2, 0, start + length), value.narrow(2, 0, start + length), None,
            is_causal=True, **kwargs,
        )
        pieces.append(out.narrow(1, start, length))  # [batch, length, heads, head_dim]
    if not pieces:
        return query.new_zeros((query.shape[0], 0, query.shape[1], query.shape[3])), None
    return torch.cat(pieces, dim=1), None


def _sdpa_core(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, kwargs: dict) -> Tensor:
    """sdpa of this rank's queries over the whole sequence's keys: chunked causal without a mask, else the mask's rows."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if mask is None:
        return chunked_causal_sdpa(module, query, key, value, None, **kwargs)[0]
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)[0]


class RecomputedAttention(torch.autograd.Function):
    """sdpa over the gathered keys and values that saves only this rank's queries, keys and
    values for backward: backward gathers the keys and values again and recomputes the
    attention (its gradients reach the local keys and values through the gather's own
    backward, a reduce-scatter). What a rank saves is then a share of the sequence, where
    saving the gathered keys and values (and sdpa's outputs over them) would be the whole.

    The attention call's keyword tensors that require grad (``names``, their values after
    the fixed arguments: a learned ``position_bias``) are inputs of the Function too, so
    they get their gradients from the recomputation; other keywords travel in ``kwargs``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, module: nn.Module, ax: Any,
        layout: Any, kwargs: dict, names: tuple[str, ...], *tensors: Tensor,
    ) -> Tensor:
        gathered = module.__dict__.pop("_hp_cp_gathered", None)
        with torch.no_grad():
            if gathered is None:
                gathered = (ax.all_gather(key, 2, total=layout.n), ax.all_gather(value, 2, total=layout.n))
            out = _sdpa_core(module, query, *gathered, mask, {**kwargs, **dict(zip(names, tensors))})
        ctx.save_for_backward(query, key, value, mask, *tensors)
        ctx.context = (module, ax, layout, kwargs, names)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        query, key, value, mask, *tensors = ctx.saved_tensors
        module, ax, layout, kwargs, names = ctx.context
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in (query, key, value, *tensors)]
        with torch.enable_grad():
            module._hp_cp_layout = layout
            out = _sdpa_core(
                module, inputs[0], ax.all_gather(inputs[1], 2, total=layout.n), ax.all_gather(inputs[2], 2, total=layout.n),
                mask, {**kwargs, **dict(zip(names, inputs[3:]))},
            )
            wanted = [t for t in inputs if t.requires_grad]
            found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        grads = [next(found) if t.requires_grad else None for t in inputs]
        return (*grads[:3], None, None, None, None, None, None, *grads[3:])


def recomputed_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[Tensor, None]:
    """The attention call of a cp training step (an ``AttentionInterface`` function): this rank's
    keys and values, gathered inside :class:`RecomputedAttention`."""
    layout = module._hp_cp_layout
    names = tuple(name for name, v in kwargs.items() if isinstance(v, Tensor) and v.requires_grad)
    rest = {name: v for name, v in kwargs.items() if name not in names}
    tensors = [kwargs[name] for name in names]
    out = RecomputedAttention.apply(
        query, key, value, attention_mask, module, module._hp_cp_axis, layout, rest, names, *tensors
    )
    return out, None


def gathered_kv_attention(module: nn.Module, *args: Any, axis: str = "cp", **kwargs: Any) -> Any:
    """The attention module's body with every rank's keys and values and this rank's mask rows.

    Bound as ``__hp_compute__`` of attention modules by an injection
    (``{"_target_": "hpgen.runtime.context_attention.gathered_kv_attention", "axis": "cp"}``).
    """
    ax = getattr(module, f"_hp_{axis}")
    if not ax.active:  # one rank, or a decode step: over the split cache if there is one
        return decode_attention(module, ax, args, kwargs)
    layout = ax.current
    if layout is None and torch._C._current_graph_task_id() != -1:
        layout = _recomputed_layout(ax, _first_tensor(args, kwargs))
    if layout is None:
        raise RuntimeError(
            f"{type(module).__name__}: context parallelism on {axis!r}: no sequence was cut in this forward "
            "(call the whole model, not the attention module alone)"
        )
    bound = module._hp_cp_signature.bind(*args, **kwargs)
    arguments = bound.arguments
    cache_name = module._hp_cp_cache
    cache = arguments.get(cache_name)
    extra = arguments.get(module._hp_cp_kwargs) or {}
    if cache is None and cache_name in extra:
        cache = extra[cache_name]
    config = module.config
    implementation = config._attn_implementation
    mask = arguments.get("attention_mask")
    routed = implementation == "sdpa" and isinstance(config, AttentionConfig)
    chunked = mask is None and routed
    if not chunked:
        dtype = _first_tensor(args, kwargs).dtype
        arguments["attention_mask"] = _query_rows(mask, layout, dtype, implementation == "eager")
    # a training step: the attention call gathers (and gathers again in backward) itself
    recompute = routed and torch.is_grad_enabled() and not torch.compiler.is_compiling()
    if not recompute:
        stand_in = GatheringCache(ax, cache)
    else:
        stand_in = None if cache is None else LocalKVCache(ax, cache, module, layout.n)
    if cache_name in extra:
        extra[cache_name] = stand_in
    else:
        arguments[cache_name] = stand_in
    if not routed:
        return module._forward_impl(*bound.args, **bound.kwargs)
    module._hp_cp_layout = layout
    module._hp_cp_axis = ax
    config._hp_route = RECOMPUTED if recompute else CHUNKED_CAUSAL if chunked else None
    try:
        return module._forward_impl(*bound.args, **bound.kwargs)
    finally:
        config._hp_route = None


def _recomputed_layout(ax: Any, hidden_states: Tensor) -> Any:
    """The layout of the sequence whose forward this backward recomputes (activation checkpointing).

    Torch's checkpoint (reentrant or not) reruns a layer during backward, after the model's
    forward ended and the axis forgot the sequence it cut. The ranks' token counts (one
    exchange; every rank recomputes the same layers in the same order) give its length, so
    the layout is the forward's own, never one remembered from another forward.
    """
    return ax.held_layout(hidden_states, 1)


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

        AttentionInterface.register(CHUNKED_CAUSAL, chunked_causal_sdpa)
        AttentionInterface.register(RECOMPUTED, recomputed_attention)
        module.config = AttentionConfig(module.config)


gathered_kv_attention.prepare = _prepare  # type: ignore[attr-defined]
