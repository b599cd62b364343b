"""What ``parallelize`` adds around a summed reduction (a parallel-residual block).

The generated block reduces the sum of its two branches' partial outputs once (the edit
in its body). Two things live outside the generated source:

- the shared input: where both branches read the output of one norm, the branches'
  input transition (``copy``, or the ``all_gather`` of a sequence-sharded stream) runs
  once, on that norm's output, in a forward hook; its backward then reduces the sum of
  both branches' partial gradients in one collective. The residual does not pass
  through it, so its gradient is not reduced;
- the branches' deferred biases: each is added, on the axis's first rank only, to the
  partial output the block sums (:class:`~hpgen.runtime.wrappers.BiasShare`, the whole
  gradient on every rank; :class:`~hpgen.runtime.wrappers.PartialBiasLinear`), so the
  single reduction adds it once, inside any dropout the source applies there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from hpgen.classify import summed_ops
from hpgen.plan import Plan, summed_branches
from hpgen.runtime.collectives import AxisCollectives
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.ops import Step, run_steps, step_for
from hpgen.runtime.params import Matched
from hpgen.runtime.wrappers import BiasShare, subclass_with

__all__ = ["SharedInput", "SummedBlock", "branch_fqns", "survey_summed"]


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


@dataclass
class SummedBlock:
    """One block instance: the shared input's hook and the branches' biases to make partial."""

    fqn: str
    shared: tuple[nn.Module, SharedInput] | None
    biases: list[nn.Linear]
    first: bool  # this rank is the axis's first: it adds the biases

    def install(self) -> None:
        if self.shared is not None:
            module, hook = self.shared
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
        shared = None
        if ops.shared_input is not None:
            module = _child(item, ops.shared_input, where)
            shared = (module, SharedInput(step_for(ops.shared, axes))) if not ops.shared.is_identity else None
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
        found.append(SummedBlock(item.fqn, shared, biases, axes[ops.axis].rank == 0))
    return found


def _child(item: Matched, path: str, where: str) -> nn.Module:
    try:
        return item.module.get_submodule(path)
    except AttributeError:
        raise ParallelizeError(f"{where}: summed_reduction shared_input {path!r} is not a module of it") from None
