"""What ``parallelize`` adds around a summed reduction (a parallel-residual block).

The generated block reduces the sum of its two branches' partial outputs once (the edit
in its body). Two things live outside the generated source:

- the shared input: where both branches read the output of one norm, the branches'
  input transition (``copy``, or the ``all_gather`` of a sequence-sharded stream) runs
  once, on that norm's output (the norm's class gets a mixin that runs its ``forward``,
  then the transition); its backward then reduces the sum of both branches' partial
  gradients in one collective. The residual does not pass through it, so its gradient is
  not reduced;
- a paired input: where each branch reads its own norm of the block input (GPT-NeoX's
  ``input_layernorm(x)`` and ``post_attention_layernorm(x)``), the first norm also
  computes the second's output on the same ``x`` and moves both, concatenated, through
  that one collective; the second norm then returns the prepared value without running
  its own ``forward``. Backward reduces both branches' partial gradients in one
  collective, and both norms' weight gradients are complete. Where the second norm is
  called on anything else, it moves its own output (two collectives, still exact). A
  ``copy`` with nothing to reduce (no gradient) is the identity, so then nothing is
  paired and each norm runs once, as in the source;
- the branches' deferred biases: each is added, on the axis's first rank only, to the
  partial output the block sums (:class:`~hpgen.runtime.forward.wrappers.BiasShare`, the whole
  gradient on every rank; :class:`~hpgen.runtime.forward.wrappers.PartialBiasLinear`), so the
  single reduction adds it once, inside any dropout the source applies there.

The norms change class rather than getting forward hooks: a hook cannot keep the second
norm's own ``forward`` from running, and any hook puts a module on ``nn.Module``'s slower
call path, on every decode step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.forward.collectives import AxisCollectives
from hpgen.runtime.forward.ops import Step, run_steps, step_for
from hpgen.runtime.forward.wrappers import BiasShare, subclass_with, with_mixin
from hpgen.runtime.install.module_decisions import ModuleDecision
from hpgen.runtime.install.params import Matched

__all__ = ["SummedBlock", "branch_fqns", "survey_summed"]

_PREPARED = "_hp_prepared"  # on the second norm: (its input, that input's version, its moved output)


class _SharedInputMixin:
    """The norm both branches read: its own ``forward``, then their input's transition, run once."""

    _hp_step: Step
    _hp_moves: bool  # the transition communicates in forward (an all_gather), not only in backward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _moved(self, super().forward(*args, **kwargs))  # type: ignore[misc]


class _PairedFirstMixin:
    """The first of two norms of one input: both outputs moved at once.

    Concatenated on the last dimension, so that the transition (``copy``, or the
    ``all_gather`` of the sequence dimension) is one collective, and its backward one
    ``all_reduce`` (one ``reduce_scatter``) of both partial gradients. A ``copy`` with no
    gradient to reduce is the identity: then nothing is paired and the second norm runs
    as it is (the decode hot path computes each norm once).
    """

    _hp_step: Step
    _hp_moves: bool  # the transition communicates in forward (an all_gather): paired without a gradient too
    _hp_paired: nn.Module  # the second norm: an instance attribute, not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        paired = self._hp_paired
        paired.__dict__.pop(_PREPARED, None)  # never a value prepared by an earlier forward
        output = super().forward(*args, **kwargs)  # type: ignore[misc]
        if not _to_move(self, output):
            return output  # a copy with no gradient to reduce: nothing to move, nothing to pair
        x = args[0] if len(args) == 1 and not kwargs else None
        other = paired._hp_own_forward(x) if isinstance(x, Tensor) else None
        if not isinstance(other, Tensor) or other.ndim < 2 or other.shape[:-1] != output.shape[:-1]:
            return run_steps(output, (self._hp_step,))  # not the two-norm shape: each norm moves its own
        width = output.shape[-1]
        both = torch.cat([output, other], dim=-1)
        moved = run_steps(both, (self._hp_step,))
        first, second = moved.split([width, other.shape[-1]], dim=-1)
        paired.__dict__[_PREPARED] = (x, _version(x), second)
        return first


class _PairedSecondMixin:
    """The second norm: the value the first prepared for this very input, without running its own ``forward``.

    Called on another input (or one changed in place since), or with nothing prepared, it
    runs its ``forward`` and moves its own output (two collectives a layer, still exact).
    """

    _hp_step: Step
    _hp_moves: bool

    def _hp_own_forward(self, x: Tensor) -> Any:
        return super().forward(x)  # type: ignore[misc]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        prepared = self.__dict__.pop(_PREPARED, None)
        if prepared is not None and len(args) == 1 and not kwargs and args[0] is prepared[0]:
            if _version(args[0]) == prepared[1]:
                return prepared[2]
        return _moved(self, super().forward(*args, **kwargs))  # type: ignore[misc]


def _to_move(module: nn.Module, output: Any) -> bool:
    """Whether the norm's ``output`` goes through the branches' input transition: not where that
    is a ``copy`` with no gradient to reduce (``copy`` returns its input then)."""
    if not isinstance(output, Tensor):
        raise TypeError(f"{type(module).__name__}: a summed reduction's shared input must return one tensor")
    return bool(module._hp_moves) or (torch.is_grad_enabled() and output.requires_grad)


def _moved(module: nn.Module, output: Any) -> Tensor:
    """``output`` through the branches' input transition, where :func:`_to_move` says it goes."""
    return run_steps(output, (module._hp_step,)) if _to_move(module, output) else output  # type: ignore[arg-type]


def _version(x: Tensor) -> int:
    """The in-place version of ``x`` (0 while compiling, where the identity check is what is traced)."""
    return 0 if torch.compiler.is_compiling() else x._version


@dataclass
class SummedBlock:
    """One block instance: the norm(s) whose output the branches read, and the branches' biases to make partial."""

    fqn: str
    shared: nn.Module | None  # the norm both branches read, or the first of two
    paired: nn.Module | None  # the second of two norms of the block input
    step: Step | None  # the branches' input transition, run on the norm's output
    moves: bool  # that transition communicates in forward (not a ``copy``)
    biases: list[nn.Linear]
    first: bool  # this rank is the axis's first: it adds the biases

    def install(self) -> None:
        # the norms change class, not hooks: a hook would let the second norm's forward run
        # and discard its output, and any hook puts the module on nn.Module's slow call path
        if self.shared is not None and self.paired is None:
            _mix_in(self.shared, _SharedInputMixin, "SharedInput", step=self.step, moves=self.moves)
        elif self.shared is not None and self.paired is not None:
            _mix_in(self.paired, _PairedSecondMixin, "PairedSecond", step=self.step, moves=self.moves)
            _mix_in(self.shared, _PairedFirstMixin, "PairedFirst", step=self.step, moves=self.moves, paired=self.paired)
        for linear in self.biases:
            linear.__class__ = subclass_with(type(linear), "partial_bias")
            # the gradient reaching a branch's partial output is the whole one on every
            # rank (the reduction's backward), so no rank's share needs its gradient summed
            linear._hp_bias_share = BiasShare(self.first, reduced=1)


def _mix_in(module: nn.Module, mixin: type, prefix: str, **attrs: Any) -> None:
    """``module`` becomes its class with ``mixin`` first; ``attrs`` become ``_hp_<name>`` instance attributes.

    Set past ``nn.Module.__setattr__``: the paired norm is a reference, not a submodule.
    """
    module.__class__ = with_mixin(type(module), mixin, prefix)
    for name, value in attrs.items():
        object.__setattr__(module, f"_hp_{name}", value)


def branch_fqns(matched: Iterable[Matched]) -> set[str]:
    """The FQNs of every summed block's branches: their outputs stay partial on purpose."""
    found = set()
    for item in matched:
        summed = item.entry.summed_reduction
        if summed is not None:
            found.update(f"{item.fqn}.{path}" for path in summed.branches)
    return found


def survey_summed(records: Sequence[ModuleDecision], axes: Mapping[str, AxisCollectives]) -> list[SummedBlock]:
    """Check each summed block's children and say what to install."""
    by_fqn = {record.fqn: record.item for record in records}
    found = []
    for record in records:
        item, ops = record.item, record.decision.summed
        if ops is None:
            continue
        where = f"{item.fqn} ({type(item.module).__name__})"
        shared = paired = step = None
        if ops.shared_input is not None and not ops.shared.is_identity:
            shared = _child(item, ops.shared_input, where)
            step = step_for(ops.shared, axes)
            if ops.paired_input is not None:
                paired = _child(item, ops.paired_input, where)
        biases = []
        for path in ops.branches:
            child = by_fqn.get(f"{item.fqn}.{path}")
            if child is None:
                raise ParallelizeError(f"{where}: summed_reduction branch {path!r} is not a module of it")
            for name in child.entry.deferred_bias_params:
                owner_path, _, leaf = name.rpartition(".")
                owner = child.module.get_submodule(owner_path) if owner_path else child.module
                if leaf != "bias" or type(owner).forward is not nn.Linear.forward or owner.bias is None:
                    raise ParallelizeError(
                        f"{child.fqn}: deferred bias {name!r} of a summed reduction's branch must be the bias of a "
                        "plain nn.Linear"
                    )
                biases.append(owner)
        moves = ops.shared is not None and ops.shared.communicates
        found.append(SummedBlock(item.fqn, shared, paired, step, moves, biases, axes[ops.axis].rank == 0))
    return found


def _child(item: Matched, path: str, where: str) -> nn.Module:
    try:
        return item.module.get_submodule(path)
    except AttributeError:
        raise ParallelizeError(f"{where}: summed_reduction input {path!r} is not a module of it") from None
