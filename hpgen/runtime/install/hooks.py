"""The two parameter fixes a sharded body needs: deferred biases and gradient reductions.

``deferred_bias_params``: a row-parallel projection (``o_proj``, ``down_proj``) makes a
partial sum; its bias must be added once, after the reduction, not on every rank. The
inner ``nn.Linear`` becomes a :class:`~hpgen.runtime.forward.wrappers.DeferredBiasLinear` (no
bias in its matmul; the Parameter stays registered where it was, so ``state_dict`` is
unchanged) and a forward hook on the boundary adds the bias to the reduced output.

``grad_reduce_params``: a replicated parameter used on a shard of the activations (a
per-head ``q_norm``, a norm on a sequence-sharded residual stream) gets only this rank's
part of its gradient. A tensor hook all-reduces that gradient over the axes on which
the boundary's body is sharded, before it is accumulated into ``.grad``. ``RS(d,r)``
parameters (key/value heads replicated on ``r`` ranks) are summed the same way, over
their replica group, and so are the rows of a ``B`` parameter's replicated blocks (multi-query
Falcon's key and value), those rows only, over the block's holders.

Because the sum happens in the tensor hook, before accumulation, the engines of the
other mesh axes see a complete gradient and need no extra step: DDP (same Parameters)
averages it over its axis; FSDP2, which swaps in Parameters of its own for the forward,
is followed by :class:`FollowReducedParameters`, a pre-hook of the boundary that hooks
whatever tensor is registered when the body runs. Apply both after ``parallelize``.

A sum over ``cp`` can instead be handed to the data-parallel engine
(:func:`hpgen.runtime.training.data_parallel` builds DDP or FSDP2 over ``dp x cp``):
:meth:`GradAllReduce.hand_to_engine` then makes the hook multiply this rank's share by the
axis size instead of all-reducing it, so the engine's average over ``dp x cp`` is the sum
over ``cp`` (bucketed, overlapped with backward, skipped while accumulating).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from hpgen.core.conv1d import is_conv1d
from hpgen.core.placement import REPLICATE
from hpgen.core.plan import Layout
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.forward.collectives import AxisCollectives
from hpgen.runtime.forward.handback import call
from hpgen.runtime.forward.ops import address_of, get_output, replace_output
from hpgen.runtime.forward.wrappers import BiasShare, subclass_with
from hpgen.runtime.install.groups import replica_group
from hpgen.runtime.install.module_decisions import ModuleDecision
from hpgen.runtime.install.params import Matched
from hpgen.core.shards import ShardLayout

__all__ = [
    "BiasAdder",
    "DeferredBias",
    "FollowReducedParameters",
    "GradAllReduce",
    "GradReduce",
    "block_regions",
    "install_grad_reduce",
    "reducers_of",
    "survey_deferred_biases",
    "survey_grad_reduce",
]


class BiasAdder:
    """Forward hook: add ``owner.bias`` to output ``name`` of the boundary's (reduced) return.

    In train mode the owner adds its share of the bias before the reduction instead
    (:class:`~hpgen.runtime.forward.wrappers.BiasShare`), so that a dropout of the partial sum
    (GPT-2's ``resid_dropout(c_proj(x))``) drops the bias with it, as the source does.
    """

    def __init__(self, owner: nn.Module, output_names: Sequence[str], name: str) -> None:
        self.owner = owner
        self.output_names = tuple(output_names)
        self.name = name

    def __call__(self, module: nn.Module, args: Any, outputs: Any) -> Any:
        if self.owner.training:
            return outputs  # the owner added it inside the body
        address = address_of(outputs, self.output_names, self.name)
        value = get_output(outputs, address)
        return replace_output(outputs, address, value + self.owner.bias)


class GradAllReduce:
    """Tensor hook: the sum over ``groups`` of a gradient each rank holds only a part of.

    ``regions``: ``(dim, start, stop, group)`` slices of the gradient summed over ``group``
    only (the replicated blocks of a ``B`` placement: Falcon's key and value rows, whose
    gradient each rank's query heads make only a part of); the other rows are whole already.
    """

    def __init__(
        self,
        groups: Sequence[dist.ProcessGroup],
        where: str,
        regions: Sequence[tuple[int, int, int, dist.ProcessGroup]] = (),
    ) -> None:
        self.groups = tuple(groups)
        self.where = where  # the parameter's FQN, for debugging
        self.regions = tuple(regions)
        self.scale = 1  # the product of the sizes of the groups handed to a data-parallel engine

    def hand_to_engine(self, ranks: Sequence[int]) -> bool:
        """Leave the sum over the group of global ``ranks`` to a data-parallel engine that AVERAGES over it
        (and over its other ranks): this hook multiplies the share by the group's size instead, so that
        the average is the sum. False when this reducer sums over no such group."""
        wanted = sorted(ranks)
        kept = [group for group in self.groups if sorted(dist.get_process_group_ranks(group)) != wanted]
        if len(kept) == len(self.groups):
            return False
        self.groups = tuple(kept)
        self.scale *= len(wanted)
        return True

    def __call__(self, grad: Tensor) -> Tensor:
        if not self.groups and not self.regions:
            return grad * self.scale  # every sum is the engine's
        total = grad.clone(memory_format=torch.contiguous_format)
        if self.scale != 1:
            total.mul_(self.scale)
        for group in self.groups:
            call(dist.all_reduce, total, group=group)
        for dim, start, stop, group in self.regions:
            piece = total.narrow(dim, start, stop - start)
            if piece.is_contiguous():
                call(dist.all_reduce, piece, group=group)
            else:
                summed = piece.contiguous()
                call(dist.all_reduce, summed, group=group)
                piece.copy_(summed)
        return total

    def __repr__(self) -> str:
        return f"GradAllReduce({self.where}, groups={len(self.groups)}, regions={len(self.regions)}, scale={self.scale})"

    def __deepcopy__(self, memo: dict) -> GradAllReduce:
        return self  # holds process-group handles, shared by copies of a model


Region = tuple[int, int, int, str, int]
"""A slice of a parameter's local gradient summed over some of an axis's ranks:
``(dim, start, stop, axis, replicas)``; ``replicas`` equal to the axis size is the whole axis."""


def block_regions(shard_layout: ShardLayout, names: Sequence[str]) -> list[Region]:
    """The replicated blocks of each ``B`` placement of ``shard_layout`` (mesh axes ``names``), as
    :meth:`~hpgen.core.shards.ShardLayout.replicated_blocks` finds them, with their axes named."""
    return [(dim, start, stop, names[axis], replicas) for axis, dim, start, stop, replicas in shard_layout.replicated_blocks()]


# --------------------------------------------------------------------------- survey and install


@dataclass
class DeferredBias:
    """One deferred bias: hidden from ``owner``'s matmul, added after ``boundary``'s reduction."""

    boundary: nn.Module
    owner: nn.Module  # the nn.Linear holding the bias (may be the boundary itself)
    output_names: tuple[str, ...]
    output: str  # the declared output the bias belongs to
    partial_axes: tuple[str, ...] = ()  # the axes the output is a partial sum on
    reduced_axes: tuple[str, ...] = ()  # the axes grad_reduce_params sum the bias's gradient over

    def install(self, axes: Mapping[str, AxisCollectives]) -> None:
        # Train mode: the first rank of the partial axes adds the bias before the reduction, the
        # others zeros; each rank's gradient, scaled to / R, is the whole one after the R ranks' sum
        # (R = 1: no sum, each rank's is already whole).
        self.owner._hp_bias_share = BiasShare(
            all(axes[a].rank == 0 for a in self.partial_axes), math.prod(axes[a].size for a in self.reduced_axes)
        )
        if hasattr(type(self.owner), "_hp_defer_bias"):
            self.owner._hp_defer_bias = True  # a wrapped (ParallelLinear) owner computes without it
        else:
            role = "deferred_bias_conv1d" if is_conv1d(self.owner) else "deferred_bias"
            self.owner.__class__ = subclass_with(type(self.owner), role)
        self.boundary.register_forward_hook(BiasAdder(self.owner, self.output_names, self.output))


def survey_deferred_biases(records: Iterable[ModuleDecision], branches: frozenset[str] = frozenset()) -> list[DeferredBias]:
    """Check each ``deferred_bias_params`` entry and say where its bias goes.

    ``branches``: FQNs of summed reductions' branches, whose biases their block places
    (:mod:`hpgen.runtime.install.summed`).
    """
    found = []
    for record in records:
        item, entry, mesh = record.item, record.entry, record.mesh
        if not entry.deferred_bias_params or item.fqn in branches:
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
            partial_axes = tuple(axis for axis in mesh if entry.output_layouts(output, mesh)[0].on(axis).is_partial)
            summed = name in entry.grad_reduce_params  # its gradient is summed over the sharded body's axes
            reduced = record.decision.sharded_axes if summed else ()
            found.append(DeferredBias(item.module, owner, entry.output_names, output, partial_axes, reduced))
    return found


@dataclass
class GradReduce:
    """A Parameter whose gradient is summed over whole axes and replica groups (union over entries).

    ``uses`` are the boundaries that reduce it, each with the (owner module, attribute)
    it is registered under there: where :class:`FollowReducedParameters` looks for it.
    """

    param: nn.Parameter
    name: str
    axes: list[str]  # grad_reduce_params: every axis its boundary's body is sharded on
    replicas: dict[str, int]  # RS(d,r): axis -> r
    uses: list[tuple[Matched, nn.Module, str]]
    regions: list[Region] = field(default_factory=list)  # B: the replicated blocks' rows

    def groups(self, axes: Mapping[str, AxisCollectives], mesh: DeviceMesh) -> list[dist.ProcessGroup]:
        """The process groups to sum over; axes of size one (and ``r`` of one) reduce nothing."""
        found = [axes[axis].group for axis in self.axes if axes[axis].size > 1]
        for axis, replicas in self.replicas.items():
            if axis not in self.axes and replicas > 1 and axes[axis].size > 1:
                found.append(replica_group(mesh, axis, replicas))
        return found

    def region_groups(self, mesh: DeviceMesh) -> list[tuple[int, int, int, dist.ProcessGroup]]:
        """The replicated blocks' slices and the group each is summed over (none on an axis whose
        whole gradient is summed already)."""
        return [
            (dim, start, stop, replica_group(mesh, axis, replicas))
            for dim, start, stop, axis, replicas in self.regions
            if axis not in self.axes
        ]


def survey_grad_reduce(records: Iterable[ModuleDecision], axes: Mapping[str, AxisCollectives]) -> list[GradReduce]:
    """Each Parameter whose gradient a rank holds only part of, with what to sum it over.

    ``grad_reduce_params`` sum over the axes the plan names for them, or else over every
    axis the boundary's body is sharded on; a sum over an axis on which the plan shards the
    parameter is refused (the ranks hold gradients of different slices). ``RS(d,r)``
    parameters over the ``r`` ranks of the axis holding the same chunk (their replica group,
    :mod:`hpgen.runtime.install.groups`); the replicated blocks of a ``B`` parameter over
    their holders, those rows only.
    """
    records = list(records)
    found: dict[int, GradReduce] = {}
    layouts = _param_layouts(record.item for record in records)

    def reduced(item: Matched, name: str) -> GradReduce:
        param = item.module.get_parameter(name)
        reduce = found.setdefault(id(param), GradReduce(param, f"{item.fqn}.{name}", [], {}, []))
        owner_path, _, attr = name.rpartition(".")
        owner = item.module.get_submodule(owner_path) if owner_path else item.module
        if not any(use.module is item.module and o is owner and a == attr for use, o, a in reduce.uses):
            reduce.uses.append((item, owner, attr))
        return reduce

    for record in records:
        item, entry, mesh = record.item, record.entry, record.mesh
        named = dict(entry.grad_reduce_axes)
        sharded: list[str] = []
        if any(name not in named for name in entry.grad_reduce_params):
            sharded = list(record.decision.sharded_axes)
            if not sharded:
                raise ParallelizeError(
                    f"{item.fqn} ({type(item.module).__name__}): grad_reduce_params, but param_plan[{item.key!r}] "
                    "shards its body on no axis, so no gradient is partial and hpgen cannot tell over which axes to "
                    "reduce. Declare the layout the input arrives in, e.g. for a norm on a sequence-sharded stream "
                    '"in_src": {"<input>": {"tp": "S(1)"}}, "in_dst": {"<input>": {"tp": "S(1)"}} '
                    "(<input> is its forward's parameter: 'input' for nn.LayerNorm)"
                )
        for name in entry.grad_reduce_params:
            reduce = reduced(item, name)
            over = named.get(name) or sharded
            _refuse_sum_over_shards(item, name, over, layouts.get(id(reduce.param)), bool(named.get(name)))
            reduce.axes += [axis for axis in over if axis not in reduce.axes]
        for name, layout in entry.params.items():
            replicated = {a: layout.on(a).replicas for a in mesh if layout.on(a).kind == "RS"}
            if replicated:
                reduced(item, name).replicas.update(replicated)
            if any(layout.on(a).kind == "B" for a in mesh):
                regions = block_regions(record.layouts[name], mesh)
                if regions:
                    reduce = reduced(item, name)
                    reduce.regions += [region for region in regions if region not in reduce.regions]
    return list(found.values())


def _param_layouts(matched: Iterable[Matched]) -> dict[int, tuple[str, Layout]]:
    """id(Parameter) -> (where the plan lays it out, its layout), from every entry's ``params``."""
    found: dict[int, tuple[str, Layout]] = {}
    for item in matched:
        for name, layout in item.entry.params.items():
            try:
                param = item.module.get_parameter(name)
            except AttributeError:
                continue  # check_param_names reports it
            found[id(param)] = (f"param_plan[{item.key!r}].params[{name!r}]", layout)
    return found


def _refuse_sum_over_shards(
    item: Matched, name: str, axes: Sequence[str], layout: tuple[str, Layout] | None, named: bool
) -> None:
    """A gradient summed over an axis on which its parameter is sharded adds different slices: refused."""
    if layout is None:
        return
    where, placements = layout
    bad = [axis for axis in axes if placements.on(axis) != REPLICATE]
    if not bad:
        return
    keep = [axis for axis in axes if axis not in bad]
    how = "it names" if named else "its body is sharded on"
    fix = f'"grad_reduce_params": {json.dumps({name: keep})}' if keep else "leave it out of grad_reduce_params"
    raise ParallelizeError(
        f"{item.fqn}.{name}: grad_reduce_params sums its gradient over {', '.join(map(repr, bad))} ({how}), "
        f"but {where} shards it there ({placements.on(bad[0])}), so the ranks hold gradients of different slices; "
        f"sum over the other axes only: {fix}"
    )


class FollowReducedParameters:
    """Forward pre-hook of a boundary: the gradient reduction follows the Parameter object.

    FSDP2 (``fully_shard``) replaces each parameter by a sharded DTensor and, for the
    forward, registers an unsharded Parameter of its own on the module; the gradient
    autograd computes is that one's. So before the boundary's body runs, the reduction
    hook goes on whatever tensor is registered there now (once per tensor). Under DDP or
    without an engine it is the Parameter ``parallelize`` made, already hooked. A DTensor
    still in place means an FSDP2 unit smaller than the boundary holds the parameter; its
    unsharded tensor appears only inside the body, where nothing can hook it in time, so
    that is refused (``RuntimeError``) rather than leaving the gradient partial.
    """

    def __init__(self, fqn: str, uses: Sequence[tuple[nn.Module, str, GradAllReduce]]) -> None:
        self.fqn = fqn
        self.uses = tuple(uses)

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for owner, attr, reducer in self.uses:
            tensor = owner._parameters.get(attr)
            if tensor is None or not tensor.requires_grad or getattr(tensor, "_hp_grad_reduce", None) is reducer:
                continue
            if _is_dtensor(tensor):
                raise RuntimeError(
                    f"{reducer.where}: hpgen sums its gradient over its tensor-parallel ranks, but when {self.fqn} "
                    "runs it is still a sharded DTensor: fully_shard was applied to a module inside that boundary. "
                    f"Apply fully_shard to {self.fqn or 'the model'} or a module above it (torchtitan's order: each "
                    "decoder layer, then the root)"
                )
            tensor.register_hook(reducer)
            tensor._hp_grad_reduce = reducer


def _is_dtensor(tensor: Tensor) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # none exists before it is imported
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def install_grad_reduce(records: Iterable[GradReduce], axes: Mapping[str, AxisCollectives], mesh: DeviceMesh) -> None:
    """Hook each Parameter as registered now (sharded, or loaded), and make every boundary using it follow it.

    Replica groups are made here, after every rank accepted the plan: creating a process
    group is a collective of all ranks.
    """
    follows: dict[int, tuple[Matched, list[tuple[nn.Module, str, GradAllReduce]]]] = {}
    for record in records:
        groups = record.groups(axes, mesh)
        regions = record.region_groups(mesh)
        if not groups and not regions:
            continue
        _, owner, attr = record.uses[0]
        param = owner._parameters[attr]  # the surveyed one was replaced by its shard, or by what was loaded
        reducer = GradAllReduce(groups, record.name, regions)
        param.register_hook(reducer)
        param._hp_grad_reduce = reducer
        for item, owner, attr in record.uses:
            follows.setdefault(id(item.module), (item, []))[1].append((owner, attr, reducer))
    for item, uses in follows.values():
        item.module.register_forward_pre_hook(FollowReducedParameters(item.fqn, uses))


def reducers_of(model: nn.Module) -> list[GradAllReduce]:
    """Every :class:`GradAllReduce` of ``model`` (its boundaries' and its adapters'), once each, in module order:
    each one is held by the :class:`FollowReducedParameters` pre-hook of a module using its Parameter."""
    found: dict[int, GradAllReduce] = {}
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, FollowReducedParameters):
                for _, _, reducer in hook.uses:
                    found.setdefault(id(reducer), reducer)
    return list(found.values())
