"""Boundaries whose class is not in the lowered file: ``nn.Embedding``, ``nn.Linear``, ``nn.Identity``, any module.

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

Any other class from outside the file (``nn.LayerNorm``, peft's ``lora.Linear``, any
``nn.Module``) gets :class:`_OutsideBoundaryMixin`, which runs its own ``forward`` between
the plan's input and output ops, whatever the contract.

The first two run the plan's input and output ops with the same movers as the generic form
(``hpgen.runtime.forward.boundary``), bound at install. :class:`DeferredBiasLinear` is the inner
``nn.Linear`` whose bias the plan defers: it computes without it, and the boundary adds
it once after the output reduction (a transformers ``Conv1D``, GPT-2's transposed linear
layer, gets the same treatment).

Subclasses of these torch classes get a subclass of their own, made on first use, so a
subclass's ``forward`` (a scaled embedding, say) still runs inside the wrapper.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hpgen.runtime.forward.ops import address_of

__all__ = [
    "BiasShare",
    "DeferredBiasLinear",
    "ParallelEmbedding",
    "ParallelLinear",
    "PartialBiasLinear",
    "PartialIdentity",
    "subclass_with",
    "with_mixin",
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
    """This rank's share of a bias (all of it, or zeros); its gradient divided by ``reduced``."""

    @staticmethod
    def forward(ctx: Any, bias: Tensor, holder: bool, reduced: int) -> Tensor:  # type: ignore[override]
        ctx.reduced = reduced
        return bias.clone() if holder else torch.zeros_like(bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return grad / ctx.reduced, None, None


class BiasShare:
    """A bias added into a partial output before its reduction: whole on one rank, zero elsewhere.

    The first of the ranks summing the partial output (``holder``) adds the whole bias,
    the others add zeros, so the reduced output holds it exactly once (no rounding of
    shares, in bfloat16 too), and a dropout of the partial sum (the same mask on every
    rank) drops it with the rest, as the source computes it. The gradient arriving at the
    partial output is the whole one on every rank, so each rank's bias gets it divided by
    ``reduced``: the whole gradient where nothing sums it (``reduced`` 1), its share where
    ``grad_reduce_params`` sum it over ``reduced`` ranks (a sequence-sharded output).
    """

    def __init__(self, holder: bool, reduced: int = 1) -> None:
        self.holder = holder
        self.reduced = reduced

    def __call__(self, bias: Tensor) -> Tensor | None:
        """This rank's share to add; None where it is zeros that no gradient flows through."""
        if not self.holder and not (torch.is_grad_enabled() and bias.requires_grad):
            return None  # adding zeros changes nothing (the decode hot path of every rank but the first)
        if self.reduced == 1:  # zero forward, the whole gradient backward: no Function needed
            return bias if self.holder else bias - bias.detach()
        return _BiasShareFunction.apply(bias, self.holder, self.reduced)


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


class _PartialBiasMixin:
    """An ``nn.Linear`` of a summed reduction's branch: its bias joins the partial sum.

    The block reduces the sum of both branches' partial outputs once, so the bias goes
    into the partial output as :class:`BiasShare` places it (on the axis's first rank, the
    whole gradient on every rank), in eval and train mode alike: it stays wherever the
    source applies it (inside a dropout the branch's output goes through), and the
    reduction adds it exactly once.
    """

    _hp_bias_share: BiasShare

    def forward(self, input: Tensor) -> Tensor:
        # added after the matmul, not fused into it: in bfloat16 the fused form measured
        # further from the float32 model (GPT-J's parity test: 0.078 against 0.070)
        output = F.linear(input, self.weight)  # type: ignore[attr-defined]
        share = self._hp_bias_share(self.bias)  # type: ignore[attr-defined]
        return output if share is None else output + share


class _OutsideBoundaryMixin:
    """Any module whose class is outside the lowered file: the plan's input ops, its own ``forward``, the output ops.

    ``_hp_signature`` is the signature the plan's value names refer to (the module's
    ``forward``; for a peft tuner layer, its base layer's, since the plan was written for
    the base model); ``_hp_boundary`` moves each declared value
    (:class:`hpgen.runtime.forward.boundary.GenericBoundary`).
    """

    _hp_boundary: Any = None
    _hp_signature: inspect.Signature | None = None
    _hp_output_names: tuple[str, ...] = ()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        boundary = self._hp_boundary
        bound = self._hp_signature.bind(*args, **kwargs)  # type: ignore[union-attr]
        for name, value in list(bound.arguments.items()):
            bound.arguments[name] = boundary.input(name, value)
        outputs = super().forward(*bound.args, **bound.kwargs)  # type: ignore[misc]
        for name in self._hp_output_names:
            outputs = boundary.output(name, outputs, address_of(outputs, self._hp_output_names, name))
        return outputs


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


class PartialBiasLinear(_PartialBiasMixin, nn.Linear):
    """``nn.Linear`` adding its bias on one rank of a summed reduction (see :class:`_PartialBiasMixin`)."""


_PREDEFINED: dict[tuple[type, type], type] = {
    (_ParallelEmbeddingMixin, nn.Embedding): ParallelEmbedding,
    (_ParallelLinearMixin, nn.Linear): ParallelLinear,
    (_DeferredBiasMixin, nn.Linear): DeferredBiasLinear,
    (_PartialBiasMixin, nn.Linear): PartialBiasLinear,
    (_PartialIdentityMixin, nn.Identity): PartialIdentity,
}
_MADE: dict[tuple[type, type], type] = {}
MIXINS = {
    "embedding": _ParallelEmbeddingMixin,
    "linear": _ParallelLinearMixin,
    "deferred_bias": _DeferredBiasMixin,
    "deferred_bias_conv1d": _DeferredBiasConv1DMixin,
    "partial_bias": _PartialBiasMixin,
    "identity_expert": _PartialIdentityMixin,
    "outside": _OutsideBoundaryMixin,
}


def subclass_with(cls: type[nn.Module], role: str) -> type[nn.Module]:
    """The class an instance of ``cls`` becomes for ``role`` (embedding, linear, deferred_bias).

    torch's own classes map to the classes above (importable, so a model still pickles);
    their subclasses get a cached ``<Role><Class>`` subclass whose mixin comes first.
    """
    prefixes = {
        "embedding": "Parallel",
        "linear": "Parallel",
        "identity_expert": "Partial",
        "partial_bias": "PartialBias",
        "outside": "Boundary",
    }
    return with_mixin(cls, MIXINS[role], prefixes.get(role, "DeferredBias"))


def with_mixin(cls: type[nn.Module], mixin: type, prefix: str) -> type[nn.Module]:
    """``cls`` with ``mixin`` first in its bases: a ``<prefix><Class>`` subclass, made once and cached."""
    key = (mixin, cls)
    if key in _PREDEFINED:
        return _PREDEFINED[key]
    if key not in _MADE:
        _MADE[key] = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
    return _MADE[key]
