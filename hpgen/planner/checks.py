"""The checks: the mesh axes divide what a translated plan shards (heads, experts, vocabulary rows).

Head-sharded attention needs the heads to divide over the axis; key/value heads fewer
than ``--tp`` (``--tp`` a multiple of them) are replicated, as vLLM does: the key/value
projections become ``RS(0, tp / kv)`` and the attention entry divides
``num_key_value_groups`` by the same number (``divide_attrs``). Experts sharded by expert
need their count to divide; a vocab-parallel embedding needs at least one row per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpgen.errors import HpgenError
from hpgen.placement import replicated_shard, shard
from hpgen.planner.boundary import Boundary

if TYPE_CHECKING:
    from hpgen.planner.plan_context import PlanContext

__all__ = ["check_sizes", "config_value", "is_attention"]


def check_sizes(context: PlanContext, sizes: Mapping[str, int], boundaries: Mapping[str, Boundary]) -> None:
    """Raise where an axis of ``sizes`` does not divide what the boundaries shard on it; replicate
    key/value heads fewer than the axis (their layouts and ``divide_attrs`` changed in place)."""
    config = context.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for axis, size in sizes.items():
        flag = "--tp" if axis == "tp" else "--ep"
        attention = [b for b in boundaries.values() if axis in b.axes and b.kind == "block" and is_attention(b)]
        if attention:
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


def _replicate_kv_heads(name: str, boundary: Boundary, axis: str, kv_heads: int, replicas: int, config: Any) -> None:
    """Fewer key/value heads than ranks: each on ``replicas`` consecutive ranks (``RS(0,r)``), as vLLM does.

    The key/value projections are the sharded parameters of the attention block whose
    dim 0 holds ``kv_heads`` heads; ``num_key_value_groups`` (query heads per key/value
    head, what ``repeat_kv`` repeats by) is divided by ``replicas`` on each rank.
    """
    head_dim = getattr(boundary.module, "head_dim", None) or config_value(config, "head_dim")
    if not isinstance(head_dim, int):
        hidden, heads = config_value(config, "hidden_size"), config_value(config, "num_attention_heads")
        head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else None
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


def config_value(config: Any, attr: str) -> Any:
    """A config attribute, or None when it is absent or ambiguous (per-layer heads)."""
    try:
        return getattr(config, attr, None)
    except Exception:  # transformers' per-layer configs raise their own error for a global read
        return None


def is_attention(boundary: Boundary) -> bool:
    last = boundary.fqn.rpartition(".")[2].lower()
    return "attention" in type(boundary.module).__name__.lower() or "attn" in last or "attention" in last
