"""The checks: the mesh axes divide what a translated plan shards (heads, experts, vocabulary rows).

Head-sharded attention keeps heads whole: where they divide over the axis, key/value heads
fewer than ``--tp`` (``--tp`` a multiple of them) are replicated, as vLLM does: the
key/value projections become ``RS(0, tp / kv)`` and the attention entry divides
``num_key_value_groups`` by the same number (``divide_attrs``). Where they do not divide,
each rank takes whole heads, some one more (:mod:`hpgen.planner.derive.heads.shares`), and a rank
left with no query head is refused. Experts sharded by expert
need their count to divide; a vocab-parallel embedding needs at least one row per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hpgen.core.errors import HpgenError
from hpgen.core.model_config import config_value
from hpgen.core.placement import replicated_shard, shard
from hpgen.core.plan_entries import LocalCount
from hpgen.planner.derive.heads.shares import HeadShares, head_shares
from hpgen.planner.translate.boundary_record import Boundary

if TYPE_CHECKING:
    from hpgen.planner.translate.plan_context import PlanContext

__all__ = ["HeadsNotCut", "check_sizes", "is_attention"]


def check_sizes(context: PlanContext, sizes: Mapping[str, int], boundaries: Mapping[str, Boundary]) -> None:
    """Raise where an axis of ``sizes`` does not divide what the boundaries shard on it; replicate
    key/value heads fewer than the axis (their layouts and ``divide_attrs`` changed in place)."""
    config = context.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for axis, size in sizes.items():
        flag = "--tp" if axis == "tp" else "--ep"
        attention = [b for b in boundaries.values() if axis in b.axes and b.kind == "block" and is_attention(b)]
        shares = _uneven_shares(context.name, text, attention, size, flag) if attention else None
        if shares is not None:
            for boundary in attention:
                _cut_whole_heads(context.name, boundary, axis, shares)
        elif attention:
            for attr in ("num_attention_heads", "num_key_value_heads"):
                value = config_value(text, attr)
                if not isinstance(value, int) or value % size == 0:
                    continue
                if attr == "num_key_value_heads" and size % value == 0:
                    for boundary in attention:
                        _replicate_kv_heads(context.name, boundary, axis, value, size // value, text)
                    continue
                raise HpgenError(
                    f"{context.name}: {attr}={value} does not divide over {flag} {size}"
                    + (f" and {flag} {size} is not a multiple of it" if attr == "num_key_value_heads" else "")
                    + f": {attention[0].fqn} is head-sharded and a rank would hold part of a head"
                )
        for boundary in boundaries.values():
            if axis not in boundary.axes:
                continue
            if boundary.kind == "experts" and boundary.injection_axis is not None:
                count = getattr(boundary.module, "num_experts", None)
                if isinstance(count, int) and count % size:
                    raise HpgenError(
                        f"{context.name}: {boundary.fqn} holds num_experts={count}, which does not divide over "
                        f"{flag} {size}"
                    )
            if boundary.kind == "embedding" and boundary.module.num_embeddings < size:
                rows = boundary.module.num_embeddings
                raise HpgenError(f"{context.name}: {boundary.fqn} has {rows} rows, fewer than {flag} {size}")


class HeadsNotCut(HpgenError):
    """Heads that do not divide the axis, in a projection transformers' plan shards whole (a fused ``qkv``) that
    hpgen cannot cut into whole heads from the plan alone: the plan derived from the source reads its layout."""


def _uneven_shares(name: str, config: Any, attention: list[Boundary], size: int, flag: str) -> HeadShares | None:
    """The heads' shares over ``size`` ranks where they do not divide (None where they do, or where the config does
    not say the counts: the checks above apply then); raise where a rank would hold no query head."""
    heads = config_value(config, "num_attention_heads")
    kv = config_value(config, "num_key_value_heads")
    kv = heads if kv is None else kv
    head_dim = _head_dim(attention[0], config)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (heads, kv, head_dim)):
        return None
    if heads < size:
        raise HpgenError(
            f"{name}: {flag} {size} leaves a rank with no query head: num_attention_heads={heads} is fewer than the "
            f"ranks ({attention[0].fqn} is head-sharded)"
        )
    if heads % kv or (kv < size and size % kv):
        return None  # the checks above say why
    shares = head_shares(heads, kv, head_dim, size)
    return None if shares.even else shares


def _cut_whole_heads(name: str, boundary: Boundary, axis: str, shares: HeadShares) -> None:
    """Heads that do not divide over ``axis``: every head-sharded parameter of the attention cut in whole heads
    (:mod:`hpgen.planner.derive.heads.shares`), and each rank's ``num_key_value_groups`` where key/value heads replicate."""
    q, kv, head_dim = shares.heads, shares.kv_heads, shares.head_dim
    counted: dict[str, LocalCount] = {}  # "query" / "keys" -> the heads a rank holds, counted from a weight's rows
    for param, layout in sorted(boundary.params.items()):
        placement = layout.on(axis)
        if placement.kind != "S":
            continue
        shape = boundary.module.get_parameter(param).shape
        dim = placement.dim % len(shape)
        n = shape[dim]
        if n == q * head_dim:
            cut = shares.query(dim, head_dim)
        elif n == kv * head_dim:
            cut = shares.keys(dim, head_dim)
        elif n == q:  # one value per query head (GPT-OSS's sinks)
            cut = shares.query(dim, 1)
        else:
            raise HeadsNotCut(
                f"{name}: {boundary.fqn}.{param} is head-sharded on dim {dim} of size {n}, which is not whole heads "
                f"of {head_dim} ({q} query, {kv} key/value heads); the heads do not divide over --{axis} {shares.tp}"
            )
        boundary.params[param] = layout.with_axis(axis, cut)
        if param.endswith("weight") and dim == 0 and n in (q * head_dim, kv * head_dim):
            counted.setdefault("query" if n == q * head_dim else "keys", LocalCount(param, 0, head_dim))
    if shares.replicas > 1:
        if not isinstance(getattr(boundary.module, "num_key_value_groups", None), int):
            raise HpgenError(
                f"{name}: num_key_value_heads={kv} is fewer than --{axis} {shares.tp}; replicating them needs "
                f"{type(boundary.module).__name__}.num_key_value_groups (what repeat_kv repeats by), which it does not "
                "have"
            )
        if "query" not in counted or "keys" not in counted:
            raise HpgenError(
                f"{name}: {boundary.fqn} has no query and key projections of its own to count each rank's "
                f"num_key_value_groups from, and its {q} query heads do not divide over --{axis} {shares.tp}"
            )
        # query heads per key/value head on each rank: what repeat_kv repeats by
        boundary.local_attrs["num_key_value_groups"] = replace(counted["query"], per=counted["keys"])


def _head_dim(boundary: Boundary, config: Any) -> int | None:
    head_dim = getattr(boundary.module, "head_dim", None) or config_value(config, "head_dim")
    if not isinstance(head_dim, int):
        hidden, heads = config_value(config, "hidden_size"), config_value(config, "num_attention_heads")
        head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else None
    return head_dim


def _replicate_kv_heads(name: str, boundary: Boundary, axis: str, kv_heads: int, replicas: int, config: Any) -> None:
    """Fewer key/value heads than ranks: each on ``replicas`` consecutive ranks (``RS(0,r)``), as vLLM does.

    The key/value projections are the sharded parameters of the attention block whose
    dim 0 holds ``kv_heads`` heads; ``num_key_value_groups`` (query heads per key/value
    head, what ``repeat_kv`` repeats by) is divided by ``replicas`` on each rank.
    """
    head_dim = _head_dim(boundary, config)
    found = []
    for param, layout in boundary.params.items():
        shape = boundary.module.get_parameter(param).shape
        if layout.on(axis) == shard(0) and isinstance(head_dim, int) and shape[0] == kv_heads * head_dim:
            boundary.params[param] = layout.with_axis(axis, replicated_shard(0, replicas))
            found.append(param)
    if not any(param.endswith("weight") for param in found):
        raise HpgenError(
            f"{name}: num_key_value_heads={kv_heads} is fewer than --{axis} {replicas * kv_heads}, and "
            f"{boundary.fqn} has no key/value projection of its own to replicate (sharded rows = "
            f"{kv_heads} x head_dim {head_dim})"
        )
    if not isinstance(getattr(boundary.module, "num_key_value_groups", None), int):
        # without it hpgen cannot say (nor parallelize check) how the local heads pair up
        raise HpgenError(
            f"{name}: num_key_value_heads={kv_heads} is fewer than --{axis} {replicas * kv_heads}; "
            f"replicating them needs {type(boundary.module).__name__}.num_key_value_groups (what repeat_kv "
            "repeats by), which it does not have"
        )
    boundary.divide_attrs["num_key_value_groups"] = replicas


def is_attention(boundary: Boundary) -> bool:
    last = boundary.fqn.rpartition(".")[2].lower()
    return "attention" in type(boundary.module).__name__.lower() or "attn" in last or "attention" in last
