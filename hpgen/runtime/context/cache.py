"""The key/value cache split over ``cp``: each rank keeps the keys and values of its own positions.

A cp prefill cuts the sequence head-tail (:mod:`hpgen.runtime.forward.context_axis`); each
rank then keeps, in the caller's ``DynamicCache``, the keys and values of the positions it
computed, about ``1/cp`` of them. Each layer of the cache becomes a :class:`SplitLayer`, a
transformers ``DynamicLayer`` whose ``keys`` and ``values`` hold this rank's positions (in
the order of ``positions``) and whose lengths (``get_seq_length``, ``get_mask_sizes``) are
the whole sequence's: transformers builds the masks and position ids of the next tokens
for the whole sequence, and ``generate``, ``return_dict_in_generate`` and a decode loop of
one's own run as with one process.

Each token a decode step adds is kept by the rank that holds the fewest positions (the
lowest such rank on ties), so the ranks stay within one token of each other as decoding
goes on. Every rank records every position's owner (one byte per position), so all of
them place the next tokens alike and ``crop`` works.

Caches of other layer types (a ``StaticCache``, sliding-window or quantized layers) and
:func:`keep_whole_cache` keep every position on every rank, as one process would, and
their decode steps run replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicLayer

__all__ = ["CacheStandIn", "SplitLayer", "body_cache", "hand_cache", "keep_prefill", "keep_whole_cache", "split_layer"]


class CacheStandIn:
    """What a cp attention body is handed as its cache: the stand-in's own ``update``, and every other
    attribute read from the caller's ``cache`` (``AttributeError`` where the caller gave none)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __getattr__(self, name: str) -> Any:
        cache = self.__dict__.get("cache")
        if cache is None:
            raise AttributeError(name)
        return getattr(cache, name)


def body_cache(arguments: dict[str, Any], cache_name: str, var_kw: str | None) -> tuple[dict[str, Any], Any]:
    """An attention body's bound ``arguments``: a copy of its ``**kwargs`` (``var_kw``), and the cache
    it was given, as its own parameter ``cache_name`` or among those keywords."""
    extra = dict(arguments.get(var_kw) or {}) if var_kw else {}
    cache = arguments.get(cache_name)
    return extra, extra.get(cache_name) if cache is None else cache


def hand_cache(arguments: dict[str, Any], extra: dict[str, Any], cache_name: str, var_kw: str | None, stand_in: Any) -> None:
    """Give the body ``stand_in`` where its cache came (its own parameter or its keywords), and the
    keywords ``extra`` (with what was added to them) as its ``**kwargs``."""
    if cache_name in extra:
        extra[cache_name] = stand_in
    else:
        arguments[cache_name] = stand_in
    if var_kw:
        arguments[var_kw] = extra


class SplitLayer(DynamicLayer):
    """A ``DynamicLayer`` holding the keys and values of this rank's positions of the sequence.

    ``positions``: the sequence position of each held key (``keys[:, :, i]`` is position
    ``positions[i]``); ``owners``: the rank holding each position of the whole sequence.
    Lengths reported to transformers are the whole sequence's.
    """

    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.rank = rank
        self.size = size
        self.positions = torch.zeros(0, dtype=torch.long)
        self.owners = torch.zeros(0, dtype=torch.int8 if size <= 127 else torch.int16)

    def __repr__(self) -> str:
        return f"SplitLayer(rank={self.rank}, size={self.size}, held={self.positions.numel()}, total={self.get_seq_length()})"

    def get_seq_length(self) -> int:
        """The whole sequence's length (every rank's positions)."""
        return int(self.owners.numel())

    def counts(self) -> list[int]:
        """How many positions each rank holds."""
        return torch.bincount(self.owners.long(), minlength=self.size).tolist()

    def place(self, m: int) -> Tensor:
        """The owner of each of ``m`` new positions: one at a time, the rank holding the fewest."""
        counts = self.counts()
        owners = []
        for _ in range(m):
            rank = min(range(self.size), key=counts.__getitem__)
            owners.append(rank)
            counts[rank] += 1
        return torch.tensor(owners, dtype=self.owners.dtype)

    def keep(self, keys: Tensor, values: Tensor, positions: Tensor, owners: Tensor) -> tuple[Tensor, Tensor]:
        """Add this rank's new ``keys``/``values`` (at ``positions``) and the owners of all new positions."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys[:, :, :0], values[:, :, :0]
            self.positions = self.positions.to(keys.device)
        self.keys = torch.cat([self.keys, keys], dim=-2)
        self.values = torch.cat([self.values, values], dim=-2)
        self.positions = torch.cat([self.positions, positions.to(self.positions.device)])
        self.owners = torch.cat([self.owners, owners.to(self.owners.dtype).cpu()])
        return self.keys, self.values

    def add(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Append whole new tokens (every rank's copy of them): keep those placed on this rank."""
        m = keys.size(-2)
        start = self.get_seq_length()
        owners = self.place(m)
        mine = (owners == self.rank).nonzero().flatten()
        positions = mine + start
        index = mine.to(keys.device)
        return self.keep(keys.index_select(-2, index), values.index_select(-2, index), positions, owners)

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        raise RuntimeError(
            "a cache split over the cp axis is filled by the context-parallel model's attention only; "
            "it cannot continue in a model that is not parallelized on the same cp group"
        )

    def reset(self) -> None:
        super().reset()
        self.positions = torch.zeros(0, dtype=torch.long)
        self.owners = self.owners[:0]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions of the sequence (transformers' convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): give the number of tokens to remove as a negative integer")
        keep = self.get_seq_length() + tokens_to_remove
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        held = (self.positions < keep).nonzero().flatten()
        self.keys = self.keys.index_select(-2, held)
        self.values = self.values.index_select(-2, held)
        self.positions = self.positions.index_select(0, held)
        self.owners = self.owners[:keep]


def split_layer(cache: Any, layer_idx: int, axis: Any) -> SplitLayer | None:
    """The :class:`SplitLayer` of ``cache`` at ``layer_idx`` for this rank of ``axis``, made from
    an empty plain ``DynamicLayer`` if need be (unless :func:`keep_whole_cache` asked for whole
    caches); ``None`` where the cache keeps whole positions."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    if isinstance(layers[layer_idx] if layer_idx < len(layers) else None, SplitLayer):  # split already: stays split
        layer = layers[layer_idx]
        if layer.size != axis.size or layer.rank != axis.rank:
            raise RuntimeError(f"cache layer {layer_idx} is split over {layer.size} ranks, this cp axis has {axis.size}")
        return layer
    if getattr(axis, "whole_cache", False):
        return None
    if getattr(cache, "layer_class_to_replicate", None) is not None:  # DynamicCache() without a config
        while len(layers) <= layer_idx:
            layers.append(cache.layer_class_to_replicate())
    if layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    if type(layer) is not DynamicLayer or layer.get_seq_length():
        return None
    layers[layer_idx] = layer = SplitLayer(axis.rank, axis.size)
    return layer


def keep_prefill(
    cache: Any, key: Tensor, value: Tensor, layout: Any, axis: Any,
    whole: Callable[[], tuple[Tensor, Tensor]], args: tuple, kwargs: dict,
) -> tuple[Tensor, Tensor]:
    """Put a cp prefill's keys and values into the caller's ``cache`` (``args``/``kwargs``: the
    rest of the body's ``update`` call, the layer index first): ``key``/``value`` are this rank's
    tokens (``layout.local``); a cache that keeps whole positions gets ``whole()``, every rank's
    keys and values. Returns what attention reads: ``whole()``, or what such a cache's
    ``update`` returns (a ``StaticCache`` returns its whole buffer)."""
    layer_idx = args[0] if args else kwargs["layer_idx"]
    layer = split_layer(cache, layer_idx, axis)
    if layer is None:
        return cache.update(*whole(), *args, **kwargs)
    if layer.get_seq_length():
        raise RuntimeError(f"cache layer {layer_idx}: a cut prefill continues a filled split cache")
    owners = torch.empty(layout.n, dtype=layer.owners.dtype)
    owners[layout.gathered.cpu()] = torch.repeat_interleave(
        torch.arange(layout.size, dtype=owners.dtype), torch.tensor(layout.sizes)
    )
    layer.keep(key.detach(), value.detach(), layout.local, owners)
    return whole()


def keep_whole_cache(model: nn.Module, whole: bool = True) -> None:
    """Make ``model``'s cp prefills keep every position's keys and values on every rank and its
    decode steps run replicated (``whole=False``: split over cp again, the default); a cache
    already split stays split. Replicated decoding needs no collective per step; the split
    cache needs ``1/cp`` of the memory."""
    axes = {id(m._hp_cp): m._hp_cp for m in model.modules() if hasattr(m, "_hp_cp")}
    if not axes:
        raise ValueError(f"{type(model).__name__}: no cp axis: parallelize it on a mesh with a 'cp' axis first")
    for ax in axes.values():
        ax.whole_cache = whole
