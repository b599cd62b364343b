"""The attribute names that hold a head size or a head count, in the modules and configs of transformers' models.

They are read by the heads rules (:mod:`~hpgen.planner.derive.heads.rules`), the reshapes
(:mod:`~hpgen.planner.derive.reshapes`) and the per-head parameters
(:mod:`~hpgen.planner.derive.heads.per_head_params`); a module of their own so that none of those imports
another for them.
"""

from __future__ import annotations

__all__ = ["HEADS_ATTRS", "HEAD_DIM_ATTRS", "KV_HEADS_ATTRS"]

HEAD_DIM_ATTRS = (
    "head_dim",
    "attention_head_size",
    "head_size",
    "d_head",
    "dim_head",
    "depth",
    "kv_channels",
    "size_per_head",
    "attn_head_size",
    "hidden_size_per_attention_head",
    "head_dim_qk",
    "qk_head_dim",
)


HEADS_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_attn_heads",
    "n_attention_heads",
    "num_q_heads",
    "num_head",
)


KV_HEADS_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads", "num_kv", "n_head_kv")
