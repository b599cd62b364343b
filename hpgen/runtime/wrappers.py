"""Boundaries whose class is not in the lowered file: ``nn.Embedding``, ``nn.Linear``, ``nn.Identity``.

hpgen cannot rewrite torch's own classes, so ``parallelize`` changes the instance's
``__class__`` to a small subclass defined here. Parameters, buffers and therefore
``state_dict`` keys stay exactly as they were; only ``forward`` changes:

- :class:`ParallelEmbedding`: with the weight sharded on the vocabulary (``S(0)``), the
  ids outside this rank's rows are masked to row 0, looked up, and their rows zeroed,
  so the ranks' outputs add up to the full lookup (``P(sum)``); the plan's output ops
  then all-reduce it (``-> R``) or reduce-scatter it (``-> S(1)``, sequence parallel).
  With the weight sharded on the embedding dim (``S(1)``) the lookup is already the
  local columns (``S(-1)``).
- :class:`ParallelLinear`: column-parallel (weight ``S(0)``: output features sharded,
  ``S(-1)``, gathered when the plan says ``-> R``; an input that arrives sharded,
  ``S(-1) -> R``, is gathered first) or row-parallel (weight ``S(1)``: input features
  sharded, output ``P(sum)``).

:class:`PartialIdentity` is an identity expert (transformers' ``moe_identity_expert``):
its output, ``R -> P(sum)``, is divided by the axis size inside the experts' sum.

The first two run the plan's input and output ops with the same movers as the generic form
(``hpgen.runtime.boundary``), bound at install. :class:`DeferredBiasLinear` is the inner
``nn.Linear`` whose bias the plan defers: it computes without it, and the boundary adds
it once after the output reduction (a transformers ``Conv1D``, GPT-2's transposed linear
layer, gets the same treatment).

Subclasses of these torch classes get a subclass of their own, made on first use, so a
subclass's ``forward`` (a scaled embedding, say) still runs inside the wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BiasShare",
    "DeferredBiasLinear",
    "ParallelEmbedding",
    "ParallelLinear",
    "PartialIdentity",
    "is_conv1d",
    "subclass_with",
]

Mover = Callable[[Any], Any]


class _ParallelEmbeddingMixin:
    """Vocab-parallel (or dim-parallel) lookup, then the plan's output ops."""

    _hp_in: Mover | None = None
    _hp_out: Mover | None = None
    _hp_vocab: tuple[int, int] | None = None  # global ids [start, stop) held here; None: all

    def forward(self, input: Tensor) -> Tensor:
        if self._hp_in is not None:
            input = self._hp_in(input)
        if self._hp_vocab is None:
            output = super().forward(input)  # type: ignore[misc]
        else:
            start, stop = self._hp_vocab
            outside = (input < start) | (input >= stop)
            output = super().forward((input - start).masked_fill(outside, 0))  # type: ignore[misc]
            output = output.masked_fill(outside.unsqueeze(-1), 0.0)
        if self._hp_out is not None:
            output = self._hp_out(output)
        return output


class _BiasShareFunction(torch.autograd.Function):
    """``bias / parts`` forward; the gradient divided by ``reduced`` instead (see :class:`BiasShare`)."""

    @staticmethod
    def forward(ctx: Any, bias: Tensor, parts: int, reduced: int) -> Tensor:  # type: ignore[override]
        ctx.reduced = reduced
        return bias / parts

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return (grad / ctx.reduced if ctx.reduced != 1 else grad), None, None


class BiasShare:
    """In train mode, a deferred bias is added before the reduction, a share on every rank.

    Each of the ``parts`` ranks summing the partial output adds ``bias / parts``, so the
    reduced output holds the bias once, and a dropout of the partial sum (the same mask on
    every rank) drops it with the rest, as the source computes it. The gradient arriving
    at the partial output is the whole one on every rank, so each rank's bias gets
    ``grad / reduced``: the whole gradient where nothing sums it (``reduced`` 1), its share
    where ``grad_reduce_params`` sum it over ``reduced`` ranks (a sequence-sharded output).
    """

    def __init__(self, parts: int, reduced: int) -> None:
        self.parts = parts
        self.reduced = reduced

    def __call__(self, bias: Tensor) -> Tensor:
        if self.parts == self.reduced:
            return bias / self.parts if self.parts != 1 else bias
        return _BiasShareFunction.apply(bias, self.parts, self.reduced)


def _bias_share(module: nn.Module) -> Tensor | None:
    """The bias a deferred-bias module adds itself: its share in train mode, none in eval mode."""
    if not module.training or module.bias is None:  # type: ignore[union-attr]
        return None
    share = getattr(module, "_hp_bias_share", None)
    return share(module.bias) if share is not None else None  # type: ignore[arg-type]


class _ParallelLinearMixin:
    """Column- or row-parallel ``nn.Linear``: input ops, the local matmul, output ops."""

    _hp_in: Mover | None = None
    _hp_out: Mover | None = None
    _hp_defer_bias = False  # the plan adds this module's bias after the output reduction

    def forward(self, input: Tensor) -> Tensor:
        if self._hp_in is not None:
            input = self._hp_in(input)
        if self._hp_defer_bias:
            output = F.linear(input, self.weight, _bias_share(self))  # type: ignore[attr-defined,arg-type]
        else:
            output = super().forward(input)  # type: ignore[misc]
        if self._hp_out is not None:
            output = self._hp_out(output)
        return output


class _DeferredBiasMixin:
    """An ``nn.Linear`` inside a boundary whose bias the boundary adds after its reduction."""

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input, self.weight, _bias_share(self))  # type: ignore[attr-defined,arg-type]


class _DeferredBiasConv1DMixin:
    """transformers' ``Conv1D`` (weight ``[in, out]``) computing without its bias, which the boundary adds."""

    def forward(self, x: Tensor) -> Tensor:
        size_out = x.size()[:-1] + (self.nf,)  # type: ignore[attr-defined]
        share = _bias_share(self)  # type: ignore[arg-type]
        if share is not None:  # as Conv1D computes it: addmm
            return torch.addmm(share, x.view(-1, x.size(-1)), self.weight).view(size_out)  # type: ignore[attr-defined]
        return torch.mm(x.view(-1, x.size(-1)), self.weight).view(size_out)  # type: ignore[attr-defined]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): ``nf`` outputs, ``nx`` inputs, weight ``[nx, nf]``, forward untouched."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nf", None), int)
        and isinstance(getattr(module, "nx", None), int)
        and isinstance(weight, Tensor)
        and weight.dim() == 2
        and getattr(type(module).forward, "__qualname__", "") == "Conv1D.forward"
    )


class _PartialIdentityMixin:
    """An identity expert inside an experts boundary: its replicated output is made partial.

    The experts boundary all-reduces the sum of the experts' outputs; an identity expert's
    output is the same on every rank, so it is divided by the axis size (``R -> P(sum)``,
    the inverse of the sum), and autograd divides its gradient alike. Its input needs no
    op: the enclosing experts boundary already reduces the input's gradient.
    """

    _hp_divisor = 1

    def forward(self, input: Tensor) -> Tensor:
        return input / self._hp_divisor if self._hp_divisor != 1 else input


class PartialIdentity(_PartialIdentityMixin, nn.Identity):
    """``nn.Identity`` as an identity expert (see :class:`_PartialIdentityMixin`)."""


class ParallelEmbedding(_ParallelEmbeddingMixin, nn.Embedding):
    """``nn.Embedding`` as a vocab-parallel boundary (see the module docstring)."""


class ParallelLinear(_ParallelLinearMixin, nn.Linear):
    """``nn.Linear`` as a column- or row-parallel boundary (see the module docstring)."""


class DeferredBiasLinear(_DeferredBiasMixin, nn.Linear):
    """``nn.Linear`` that leaves its bias to the enclosing boundary (``deferred_bias_params``)."""


_PREDEFINED: dict[tuple[type, type], type] = {
    (_ParallelEmbeddingMixin, nn.Embedding): ParallelEmbedding,
    (_ParallelLinearMixin, nn.Linear): ParallelLinear,
    (_DeferredBiasMixin, nn.Linear): DeferredBiasLinear,
    (_PartialIdentityMixin, nn.Identity): PartialIdentity,
}
_MADE: dict[tuple[type, type], type] = {}
MIXINS = {
    "embedding": _ParallelEmbeddingMixin,
    "linear": _ParallelLinearMixin,
    "deferred_bias": _DeferredBiasMixin,
    "deferred_bias_conv1d": _DeferredBiasConv1DMixin,
    "identity_expert": _PartialIdentityMixin,
}


def subclass_with(cls: type[nn.Module], role: str) -> type[nn.Module]:
    """The class an instance of ``cls`` becomes for ``role`` (embedding, linear, deferred_bias).

    torch's own classes map to the classes above (importable, so a model still pickles);
    their subclasses get a cached ``<Role><Class>`` subclass whose mixin comes first.
    """
    mixin = MIXINS[role]
    key = (mixin, cls)
    if key in _PREDEFINED:
        return _PREDEFINED[key]
    if key not in _MADE:
        prefix = {"embedding": "Parallel", "linear": "Parallel", "identity_expert": "Partial"}.get(role, "DeferredBias")
        _MADE[key] = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
    return _MADE[key]
