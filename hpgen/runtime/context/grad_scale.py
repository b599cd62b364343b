"""An identity whose backward multiplies the gradient: a parameter's share made to average right.

When a data-parallel engine sums gradients over ``cp`` (:func:`hpgen.runtime.training.data_parallel`),
it AVERAGES over its ranks. A parameter that a cp rank uses on its own tokens only (the language-model
head of :mod:`hpgen.runtime.context_logits`) gets this rank's share of its gradient; multiplied by the
cp size, the engine's average over the cp ranks is the sum of the shares, with no collective of ours.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["scale_grad"]


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def scale_grad(x: Tensor, factor: float) -> Tensor:
    """``x`` itself in the forward; its gradient times ``factor`` in backward (``factor`` one: ``x``)."""
    if factor == 1:
        return x
    return _ScaleGrad.apply(x, factor)
