"""What context parallelism (a ``cp`` axis) does not cover, read from a model's config.

The ``cp`` axis cuts the sequence and gathers every rank's keys and values in attention,
with this rank's rows of the mask transformers builds for the whole sequence. That is
exact for causal softmax attention over rotary positions; the planner (``hpgen plan
--cp``) and ``parallelize`` both refuse, through :func:`context_refusal`, the attention
kinds it has not been shown exact on. Plain data: no torch, no transformers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONTEXT_AXIS", "context_refusal"]

CONTEXT_AXIS = "cp"
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
