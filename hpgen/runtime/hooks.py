"""The two parameter fixes a sharded body needs: deferred biases and gradient reductions.

``deferred_bias_params``: a row-parallel projection (``o_proj``, ``down_proj``) makes a
partial sum; its bias must be added once, after the reduction, not on every rank. The
inner ``nn.Linear`` becomes a :class:`~hpgen.runtime.wrappers.DeferredBiasLinear` (no
bias in its matmul; the Parameter stays registered where it was, so ``state_dict`` is
unchanged) and a forward hook on the boundary adds the bias to the reduced output.

``grad_reduce_params``: a replicated parameter used on a shard of the activations (a
per-head ``q_norm``, a norm on a sequence-sharded residual stream) gets only this rank's
part of its gradient. A tensor hook all-reduces that gradient over the axes on which
the boundary's body is sharded, before it is accumulated into ``.grad``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hpgen.plan import Plan, body_is_sharded
from hpgen.runtime.collectives import AxisCollectives
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.ops import address_of, get_output, replace_output
from hpgen.runtime.params import Matched
from hpgen.runtime.wrappers import is_conv1d, subclass_with

__all__ = [
    "BiasAdder",
    "DeferredBias",
    "GradAllReduce",
    "GradReduce",
    "install_grad_reduce",
    "survey_deferred_biases",
    "survey_grad_reduce",
]


class BiasAdder:
    """Forward hook: add ``owner.bias`` to output ``name`` of the boundary's (reduced) return."""

    def __init__(self, owner: nn.Module, output_names: Sequence[str], name: str) -> None:
        self.owner = owner
        self.output_names = tuple(output_names)
        self.name = name

    def __call__(self, module: nn.Module, args: Any, outputs: Any) -> Any:
        address = address_of(outputs, self.output_names, self.name)
        value = get_output(outputs, address)
        return replace_output(outputs, address, value + self.owner.bias)


class GradAllReduce:
    """Tensor hook: the sum over ``groups`` of a gradient each rank holds only a part of."""

    def __init__(self, groups: Sequence[dist.ProcessGroup], where: str) -> None:
        self.groups = tuple(groups)
        self.where = where  # the parameter's FQN, for debugging

    def __call__(self, grad: Tensor) -> Tensor:
        total = grad.clone(memory_format=torch.contiguous_format)
        for group in self.groups:
            dist.all_reduce(total, group=group)
        return total

    def __repr__(self) -> str:
        return f"GradAllReduce({self.where}, groups={len(self.groups)})"

    def __deepcopy__(self, memo: dict) -> GradAllReduce:
        return self  # holds process-group handles, shared by copies of a model


# --------------------------------------------------------------------------- survey and install


@dataclass
class DeferredBias:
    """One deferred bias: hidden from ``owner``'s matmul, added after ``boundary``'s reduction."""

    boundary: nn.Module
    owner: nn.Module  # the nn.Linear holding the bias (may be the boundary itself)
    output_names: tuple[str, ...]
    output: str  # the declared output the bias belongs to

    def install(self) -> None:
        if hasattr(type(self.owner), "_hp_defer_bias"):
            self.owner._hp_defer_bias = True  # a wrapped (ParallelLinear) owner computes without it
        else:
            role = "deferred_bias_conv1d" if is_conv1d(self.owner) else "deferred_bias"
            self.owner.__class__ = subclass_with(type(self.owner), role)
        self.boundary.register_forward_hook(BiasAdder(self.owner, self.output_names, self.output))


def survey_deferred_biases(matched: Iterable[Matched], plan: Plan) -> list[DeferredBias]:
    """Check each ``deferred_bias_params`` entry and say where its bias goes."""
    mesh = plan.mesh_dim_names
    found = []
    for item in matched:
        entry = item.entry
        if not entry.deferred_bias_params:
            continue
        where = f"{item.fqn} ({type(item.module).__name__})"
        partial = [
            name
            for name in entry.output_names
            if any(entry.output_layouts(name, mesh)[0].on(axis).is_partial for axis in mesh)
        ]
        if len(partial) != 1:
            raise ParallelizeError(
                f"{where}: deferred_bias_params need exactly one partial output (out_src P(...)) to add them to "
                f"after its reduction; param_plan[{item.key!r}] has {len(partial)}"
            )
        output = partial[0]
        dst = entry.output_layouts(output, mesh)[1]
        if any(dst.on(axis).is_partial for axis in mesh):
            raise ParallelizeError(
                f"{where}: output {output!r} is still partial after the boundary (out_dst {dst}); a deferred bias "
                "would be added on every rank"
            )
        sharded_dst = [axis for axis in mesh if dst.on(axis).kind in ("S", "SS")]
        for name in entry.deferred_bias_params:
            owner_path, _, leaf = name.rpartition(".")
            owner = item.module.get_submodule(owner_path) if owner_path else item.module
            if leaf != "bias" or not (isinstance(owner, nn.Linear) or is_conv1d(owner)):
                raise ParallelizeError(
                    f"{where}: deferred bias {name!r} must be the 'bias' of an nn.Linear (or transformers' Conv1D); "
                    f"{owner_path or '<the module>'} is a {type(owner).__name__}"
                )
            if owner is not item.module and isinstance(owner, nn.Linear) and type(owner).forward is not nn.Linear.forward:
                raise ParallelizeError(
                    f"{where}: {owner_path} ({type(owner).__name__}) overrides nn.Linear.forward; its bias cannot "
                    "be deferred without changing that forward"
                )
            if sharded_dst and name not in entry.grad_reduce_params:
                raise ParallelizeError(
                    f"{where}: deferred bias {name!r} is added to output {output!r}, which is sharded on "
                    f"{', '.join(sharded_dst)} (out_dst {dst}): each rank sees part of its gradient; "
                    "add it to grad_reduce_params"
                )
            found.append(DeferredBias(item.module, owner, entry.output_names, output))
    return found


@dataclass
class GradReduce:
    """A replicated Parameter whose gradient is summed over ``axes`` (union over the entries naming it)."""

    param: nn.Parameter
    name: str
    axes: list[str]


def survey_grad_reduce(matched: Iterable[Matched], plan: Plan) -> list[GradReduce]:
    """Each ``grad_reduce_params`` Parameter with the axes its boundary's body is sharded on."""
    found: dict[int, GradReduce] = {}
    for item in matched:
        entry = item.entry
        if not entry.grad_reduce_params:
            continue
        axes = [axis for axis in plan.mesh_dim_names if body_is_sharded(entry, axis)]
        if not axes:
            raise ParallelizeError(
                f"{item.fqn} ({type(item.module).__name__}): grad_reduce_params, but param_plan[{item.key!r}] "
                "shards its body on no axis, so no gradient is partial and hpgen cannot tell over which axes to "
                "reduce. Declare the layout the input arrives in, e.g. for a norm on a sequence-sharded stream "
                '"in_src": {"<input>": {"tp": "S(1)"}}, "in_dst": {"<input>": {"tp": "S(1)"}} '
                "(<input> is its forward's parameter: 'input' for nn.LayerNorm)"
            )
        for name in entry.grad_reduce_params:
            param = item.module.get_parameter(name)
            record = found.setdefault(id(param), GradReduce(param, f"{item.fqn}.{name}", []))
            record.axes += [axis for axis in axes if axis not in record.axes]
    return list(found.values())


def install_grad_reduce(
    records: Iterable[GradReduce], axes: Mapping[str, AxisCollectives], replaced: Mapping[int, nn.Parameter]
) -> None:
    """Register the gradient all-reduce on each (possibly re-created) Parameter; size-1 axes skip."""
    for record in records:
        groups = [axes[axis].group for axis in record.axes if axes[axis].size > 1]
        if groups:
            param = replaced.get(id(record.param), record.param)
            param.register_hook(GradAllReduce(groups, record.name))
