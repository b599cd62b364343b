"""The ``cp`` axis's names, and what context parallelism does not cover (read from a config).

The ``cp`` axis cuts the sequence and gathers every rank's keys and values in attention,
with this rank's rows of the mask transformers builds for the whole sequence. That is
exact for causal softmax attention over rotary positions; the planner (``hpgen plan
--cp``) and ``parallelize`` both refuse, through :func:`context_refusal`, the attention
kinds it has not been shown exact on. Plain data: no torch, no transformers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONTEXT_AXIS", "GATHERED_KV_ATTENTION", "HEAD_TAIL", "context_refusal", "gathered_kv_ops"]

CONTEXT_AXIS = "cp"
# the region function of attention on a cp axis, as plans name it (in hpgen.runtime.context.attention:
# hpgen.core.plan_targets)
GATHERED_KV_ATTENTION = "hpgen.runtime.context_attention.gathered_kv_attention"
HEAD_TAIL = "head-tail layout: the sequence in 2*cp chunks (tensor_split sizes), rank r holds chunks r and 2*cp-1-r"


def gathered_kv_ops(axis: str) -> list[dict[str, object]]:
    """What ``gathered_kv_attention`` moves inside the attention body, as ``hpgen explain`` lists ops."""
    gather = dict(
        axis=axis, src="S(2)", dst="R", op="all_gather", args={"dim": 2}, backward="reduce_scatter",
        why=f"every query needs every rank's keys and values, gathered after the rotary step: in a training step "
        f"inside the sdpa call, and again in backward, which recomputes the attention (only this rank's keys and "
        f"values are saved); otherwise where the body calls its cache's update ({HEAD_TAIL})",
    )
    mask = dict(
        value="attention_mask", axis=axis, src="R", dst="S(2)", op="rows", args={}, backward="none",
        why="this rank's query rows of the whole sequence's mask (the causal mask of its global positions "
        "where transformers left it to sdpa's is_causal); no communication",
    )
    return [{"value": "key_states", **gather}, {"value": "value_states", **gather}, mask]
_RECURRENT = ("mamba", "linear", "recurrent", "conv", "rwkv", "delta", "ssm", "lightning")


def context_refusal(config: Any) -> str | None:
    """Why context parallelism does not cover the model of ``config`` (one clause), or ``None``."""
    window = _sliding_window(config)
    if window is not None:
        return f"sliding-window attention (config.sliding_window={window})"
    attn_config = getattr(config, "attn_config", None)
    if (
        getattr(config, "alibi", False)
        or getattr(config, "position_embedding_type", None) == "alibi"
        or getattr(config, "model_type", None) == "bloom"
        or getattr(attn_config, "alibi", False)
    ):
        return "ALiBi attention"
    kinds = sorted({str(kind) for kind in getattr(config, "layer_types", None) or () if _is_recurrent(kind)})
    if kinds:
        return f"recurrent or linear-attention layers (config.layer_types has {', '.join(kinds)})"
    if getattr(config, "is_causal", True) is False:
        return "bidirectional attention (config.is_causal=False)"
    return None


def _sliding_window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and not any("sliding" in str(kind) for kind in kinds):
        return None
    return window


def _is_recurrent(kind: Any) -> bool:
    text = str(kind).lower()
    return "attention" not in text.replace("linear_attention", "") and any(word in text for word in _RECURRENT)
