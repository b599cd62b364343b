"""The exact merge of attention computed over disjoint parts of the keys, by log-sum-exp.

Attention of a query over keys split into parts ``K_1 ... K_p`` is a weighted mean of the
parts' own attention outputs: part ``i`` with output ``o_i`` and log-sum-exp ``l_i`` of
its scores weighs ``exp(l_i - l)``, where ``l = log(sum_i exp(l_i))`` is the log-sum-exp
over all keys. Decoding over a cache split across ranks (each rank's part) and ring or
chunked attention (each block's part) combine their pieces this way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["merge_partials"]


def merge_partials(outputs: Tensor | Sequence[Tensor], lses: Tensor | Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """The attention over the union of the parts' keys, and its log-sum-exp.

    ``outputs``: the parts' outputs, ``[..., d]`` each (a sequence, or stacked on dim 0);
    ``lses``: their log-sum-exps, ``[...]`` each (the output's shape without ``d``). A part
    whose keys are all masked for a query has log-sum-exp ``-inf`` and weighs nothing; where
    every part is masked the output is 0 and the log-sum-exp ``-inf``. The result is
    computed in float32 (or float64 if given) and returned in ``outputs``' dtype.
    """
    out = outputs if isinstance(outputs, Tensor) else torch.stack(list(outputs))
    lse = lses if isinstance(lses, Tensor) else torch.stack(list(lses))
    if out.shape[:-1] != lse.shape:
        raise ValueError(f"merge_partials: outputs {tuple(out.shape)} need log-sum-exps of shape {tuple(out.shape[:-1])}, got {tuple(lse.shape)}")
    dtype = torch.promote_types(lse.dtype, torch.float32)
    lse = lse.to(dtype)
    top = lse.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # every part masked: no shift
    weights = torch.exp(lse - top)  # [parts, ...]; exp(-inf) = 0
    total = weights.sum(0)
    merged = (weights.unsqueeze(-1) * out.to(dtype)).sum(0) / total.clamp_min(torch.finfo(dtype).tiny).unsqueeze(-1)
    return merged.to(out.dtype), top + torch.log(total)
