"""What ``parallelize`` adds around a summed reduction (a parallel-residual block).

The generated block reduces the sum of its two branches' partial outputs once (the edit
in its body). Two things live outside the generated source:

- the shared input: where both branches read the output of one norm, the branches'
  input transition (``copy``, or the ``all_gather`` of a sequence-sharded stream) runs
  once, on that norm's output, in a forward hook; its backward then reduces the sum of
  both branches' partial gradients in one collective. The residual does not pass
  through it, so its gradient is not reduced;
- a paired input: where each branch reads its own norm of the block input (GPT-NeoX's
  ``input_layernorm(x)`` and ``post_attention_layernorm(x)``), the first norm's hook
  computes the second's output on the same ``x`` as well and moves both, concatenated,
  through that one collective; the second norm's hook then returns the prepared value.
  Backward reduces both branches' partial gradients in one collective, and both norms'
  weight gradients are complete. Where the second norm is called on anything else, its
  hook moves its own output (two collectives, still exact);
- the branches' deferred biases: each is added, on the axis's first rank only, to the
  partial output the block sums (:class:`~hpgen.runtime.wrappers.BiasShare`, the whole
  gradient on every rank; :class:`~hpgen.runtime.wrappers.PartialBiasLinear`), so the
  single reduction adds it once, inside any dropout the source applies there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hpgen.classify import summed_ops
from hpgen.plan import Plan, summed_branches
from hpgen.runtime.collectives import AxisCollectives
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.ops import Step, run_steps, step_for
from hpgen.runtime.params import Matched
from hpgen.runtime.wrappers import BiasShare, subclass_with

__all__ = ["PairedInput", "PairedOutput", "SharedInput", "SummedBlock", "branch_fqns", "survey_summed"]

_PAIRED = "_hp_paired_norm"  # on the first norm: the second (plain attribute, no submodule)
_PREPARED = "_hp_paired_prepared"  # on the second norm: (its input, that input's version, its moved output)


class SharedInput:
    """Forward hook of the norm both branches read: their input's transition, run once."""

    def __init__(self, step: Step) -> None:
        self.step = step

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, Tensor):
            raise TypeError(f"{type(module).__name__}: a summed reduction's shared input must return one tensor")
        return run_steps(output, (self.step,))

    def __deepcopy__(self, memo: dict) -> SharedInput:
        return self  # holds a bound collective of a process group


class PairedInput:
    """Forward hook of the first of two norms of one input: both outputs moved at once.

    Concatenated on the last dimension, so that the transition (``copy``, or the
    ``all_gather`` of the sequence dimension) is one collective, and its backward one
    ``all_reduce`` (one ``reduce_scatter``) of both partial gradients.
    """

    def __init__(self, step: Step) -> None:
        self.step = step

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, Tensor):
            raise TypeError(f"{type(module).__name__}: a summed reduction's shared input must return one tensor")
        paired = module.__dict__[_PAIRED]
        x = args[0] if len(args) == 1 else None
        other = paired.forward(x) if isinstance(x, Tensor) else None  # the hooks of ``paired`` stay out
        if not isinstance(other, Tensor) or other.ndim < 2 or other.shape[:-1] != output.shape[:-1]:
            return run_steps(output, (self.step,))  # not the two-norm shape: each norm moves its own
        width = output.shape[-1]
        moved = run_steps(torch.cat([output, other], dim=-1), (self.step,))
        first, second = moved.split([width, other.shape[-1]], dim=-1)
        paired.__dict__[_PREPARED] = (x, _version(x), second)
        return first

    def __deepcopy__(self, memo: dict) -> PairedInput:
        return self  # holds a bound collective; the modules it reads travel with the model


class PairedOutput:
    """Forward hook of the second norm: the value :class:`PairedInput` prepared for this very input.

    Called on another input (or one changed in place since), it moves its own output.
    """

    def __init__(self, step: Step) -> None:
        self.step = step

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        prepared = module.__dict__.pop(_PREPARED, None)
        if prepared is not None and len(args) == 1 and args[0] is prepared[0] and _version(args[0]) == prepared[1]:
            return prepared[2]
        return run_steps(output, (self.step,))

    def __deepcopy__(self, memo: dict) -> PairedOutput:
        return self


def _version(x: Tensor) -> int:
    """The in-place version of ``x`` (0 while compiling, where the identity check is what is traced)."""
    return 0 if torch.compiler.is_compiling() else x._version


@dataclass
class SummedBlock:
    """One block instance: the shared input's hook and the branches' biases to make partial."""

    fqn: str
    shared: tuple[nn.Module, SharedInput | PairedInput] | None
    paired: tuple[nn.Module, PairedOutput] | None
    biases: list[nn.Linear]
    first: bool  # this rank is the axis's first: it adds the biases

    def install(self) -> None:
        if self.shared is not None:
            module, hook = self.shared
            module.register_forward_hook(hook)
        if self.paired is not None and self.shared is not None:
            module, hook = self.paired
            self.shared[0].__dict__[_PAIRED] = module
            module.register_forward_hook(hook)
        for linear in self.biases:
            linear.__class__ = subclass_with(type(linear), "partial_bias")
            # the gradient reaching a branch's partial output is the whole one on every
            # rank (the reduction's backward), so no rank's share needs its gradient summed
            linear._hp_bias_share = BiasShare(self.first, reduced=1)


def branch_fqns(matched: Iterable[Matched], plan: Plan) -> set[str]:
    """The FQNs of every summed block's branches: their outputs stay partial on purpose."""
    found = set()
    for item in matched:
        summed = item.entry.summed_reduction
        if summed is not None:
            found.update(f"{item.fqn}.{path}" for path in summed.branches)
    return found


def survey_summed(matched: list[Matched], plan: Plan, axes: Mapping[str, AxisCollectives]) -> list[SummedBlock]:
    """Check each summed block's children and say what to install."""
    by_fqn = {item.fqn: item for item in matched}
    found = []
    for item in matched:
        if item.entry.summed_reduction is None:
            continue
        where = f"{item.fqn} ({type(item.module).__name__})"
        ops = summed_ops(plan, item.key)
        assert ops is not None
        shared = paired = None
        if ops.shared_input is not None and not ops.shared.is_identity:
            module = _child(item, ops.shared_input, where)
            step = step_for(ops.shared, axes)
            if ops.paired_input is None:
                shared = (module, SharedInput(step))
            else:
                shared = (module, PairedInput(step))
                paired = (_child(item, ops.paired_input, where), PairedOutput(step))
        biases = []
        for branch in summed_branches(plan.entries, plan.mesh_dim_names, item.key)[1]:
            child = by_fqn.get(f"{item.fqn}.{branch.path}")
            if child is None:
                raise ParallelizeError(f"{where}: summed_reduction branch {branch.path!r} is not a module of it")
            for name in child.entry.deferred_bias_params:
                owner_path, _, leaf = name.rpartition(".")
                owner = child.module.get_submodule(owner_path) if owner_path else child.module
                if leaf != "bias" or type(owner).forward is not nn.Linear.forward or owner.bias is None:
                    raise ParallelizeError(
                        f"{child.fqn}: deferred bias {name!r} of a summed reduction's branch must be the bias of a "
                        "plain nn.Linear"
                    )
                biases.append(owner)
        found.append(SummedBlock(item.fqn, shared, paired, biases, axes[ops.axis].rank == 0))
    return found


def _child(item: Matched, path: str, where: str) -> nn.Module:
    try:
        return item.module.get_submodule(path)
    except AttributeError:
        raise ParallelizeError(f"{where}: summed_reduction input {path!r} is not a module of it") from None
