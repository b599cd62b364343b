"""The generic form's ``_hp_boundary``: each declared value moved from its src to its dst layout.

A class lands in the generic form when some transition has no collective (``R -> P``,
``S -> P``, a reduce-scatter of ``P(avg)``, ...) or when its ``forward`` fails a static
gate (an input that arrives in ``**kwargs``). Its generated ``forward`` hands every
declared value to ``self._hp_boundary``; this module builds that object.

Each value gets the cheapest mover that is right for it: when all of its transitions are
ordinary collectives it runs them through the axes' :class:`AxisCollectives`, exactly as
the tp_collective form would (``P(avg|max|min) -> S(d)`` too, as ``all_reduce`` then
``split``); only a value with a transition that has no collective goes through DTensor:
``from_local`` (in the src placements, with the global shape gathered from the ranks, so
uneven shards work) → ``redistribute`` → ``to_local``, and a local partition for
``-> P``, which DTensor's public API refuses.

DTensor cannot know what the body does with a value, so the gradient placements are
given explicitly, with the same rule as the static ops (``hpgen.core.transitions``): a
replicated input of a body that is sharded on an axis gets a *partial* gradient there
(all-reduced on the way back); every other gradient has the placement of its value,
with partial values taking replicated gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from hpgen.core.decision import EntryDecision, entry_decision
from hpgen.core.transitions import ValueOps
from hpgen.core.placement import Placement
from hpgen.core.plan import Layout, Plan
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.forward.collectives import AxisCollectives
from hpgen.runtime.forward.handback import call
from hpgen.runtime.forward.ops import (
    Address,
    Step,
    get_output,
    replace_output,
    run_steps,
    steps_for,
)
from hpgen.core.shards import chunk_sizes, normalize_dim, split_sizes

if TYPE_CHECKING:  # DTensor takes seconds to import: only values that need it load it
    from torch.distributed.tensor.placement_types import Placement as DPlacement

__all__ = ["DTensorMove", "GenericBoundary", "StaticMove", "boundary_movers", "decision_movers", "mover_for"]


class StaticMove:
    """A value whose transitions are all collectives: the bound ``AxisCollectives`` calls."""

    def __init__(self, steps: tuple[Step, ...]) -> None:
        self.steps = steps

    def __call__(self, x: Any) -> Any:
        return run_steps(x, self.steps)


class DTensorMove:
    """A value moved through DTensor ``redistribute`` (transitions with no collective).

    DTensor's public ``redistribute`` refuses to make a value partial, so a transition
    to ``P(op)`` redistributes to ``R`` on that axis and then partitions locally: for
    ``sum`` the rank at coordinate 0 of the partial axes keeps the value and the others
    hold zeros (exact, unlike dividing); ``avg``, ``max`` and ``min`` keep it everywhere.
    The gradient of a partial value is replicated, so the partition's backward is the
    identity.
    """

    def __init__(
        self,
        name: str,
        mesh: DeviceMesh,
        src: tuple[Placement, ...],
        dst: tuple[Placement, ...],
        grad_src: tuple[DPlacement, ...],
        grad_dst: tuple[DPlacement, ...],
    ) -> None:
        from torch.distributed.tensor import Replicate

        from hpgen.runtime.shard_layout import dtensor_placement

        self.name = name
        self.mesh = mesh
        self.src = src  # hpgen placements, one per mesh dim (in the mesh's order)
        self.src_dt = tuple(dtensor_placement(p) for p in src)
        # Axes made partial here: redistribute to R there, then partition locally.
        made_partial = [i for i, (a, b) in enumerate(zip(src, dst)) if b.is_partial and a != b]
        self.mid_dt = tuple(Replicate() if i in made_partial else dtensor_placement(p) for i, p in enumerate(dst))
        self.grad_src = grad_src
        self.grad_mid = tuple(Replicate() if i in made_partial else g for i, g in enumerate(grad_dst))
        coordinate = mesh.get_coordinate() or []
        self.zero_here = any(dst[i].op == "sum" and coordinate[i] != 0 for i in made_partial)
        self.partitions = bool(made_partial)

    def __call__(self, x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x  # None, or a non-tensor value that has no layout
        from torch.distributed.tensor import DTensor

        shape = self._global_shape(x)
        stride = torch.empty(shape, device="meta").stride()
        value = DTensor.from_local(
            x, self.mesh, self.src_dt, run_check=False, shape=shape, stride=stride, grad_placements=self.grad_src
        )
        local = value.redistribute(self.mesh, self.mid_dt).to_local(grad_placements=self.grad_mid)
        if self.partitions:
            local = _Partition.apply(local, self.zero_here)
        return local

    def _global_shape(self, x: Tensor) -> torch.Size:
        """The logical shape: each sharded dim's local sizes gathered over its axis.

        Axes are undone in reverse mesh order, so a dim sharded on two axes adds up first
        over the inner one. DTensor splits like ``torch.chunk``; a split that differs from
        ``torch.tensor_split`` (docs/plan-format.md) is refused rather than silently misread.
        """
        shape = list(x.shape)
        for index in reversed(range(len(self.src))):
            placement = self.src[index]
            if not placement.is_shard:
                continue
            dim = normalize_dim(placement.dim, x.dim())
            group = self.mesh.get_group(index)
            size = dist.get_world_size(group)
            mine = torch.tensor([shape[dim]], dtype=torch.int64, device=x.device)
            every = [torch.empty_like(mine) for _ in range(size)]
            call(dist.all_gather, every, mine, group=group)
            sizes = tuple(int(t.item()) for t in every)
            total = sum(sizes)
            if sizes != split_sizes(total, size) or sizes != chunk_sizes(total, size):
                raise RuntimeError(
                    f"{self.name}: shards of sizes {sizes} on mesh dim {self.mesh.mesh_dim_names[index]!r} "
                    f"are not both torch.tensor_split's and DTensor's (torch.chunk's) split of {total}; "
                    "the generic (DTensor) path cannot move them"
                )
            shape[dim] = total
        return torch.Size(shape)


class _Partition(torch.autograd.Function):
    """``R -> P``: this rank's part of a replicated value (the value, or zeros); gradient unchanged."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, zero: bool) -> Tensor:  # type: ignore[override]
        return torch.zeros_like(x) if zero else x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def _grad_placement(placement: Placement, *, partial: bool) -> DPlacement:
    """The placement of a value's gradient: partial when asked, replicated for a partial value."""
    from torch.distributed.tensor import Partial, Replicate

    from hpgen.runtime.shard_layout import dtensor_placement

    if partial:
        return Partial("sum")
    if placement.is_partial:
        return Replicate()
    return dtensor_placement(placement)


def mover_for(
    value: ValueOps,
    layouts: tuple[Layout, Layout],
    *,
    side: str,
    sharded: Mapping[str, bool],
    mesh: DeviceMesh,
    axes: Mapping[str, AxisCollectives],
    where: str,
) -> StaticMove | DTensorMove:
    """The mover of one declared value (``side`` ``in`` or ``out``), static when it can be.

    ``P(avg|max|min) -> S(d)`` has no reduce-scatter, but ``all_reduce(op)`` then
    ``split(d)`` is exact, with the right gradient (``1/size`` for avg, the arg-max mask
    for max/min) where DTensor would hand every rank the unscaled gradient; so those
    stay static too. The rest of the generic transitions go through DTensor.
    """
    steps: list[Step] = []
    for op in value.ops:
        if op.kind != "generic":
            steps += steps_for(ValueOps(value.name, (op,)), axes)
        elif op.src.is_partial and op.src.op != "sum" and op.dst.is_shard:
            ax = axes[op.axis]
            steps += [(ax.all_reduce, {"op": op.src.op}), (ax.split, {"dim": op.dst.dim})]
        else:
            break
    else:
        return StaticMove(tuple(steps))
    src, dst = layouts
    names = tuple(mesh.mesh_dim_names or ())
    src_p = tuple(src.on(axis) for axis in names)
    dst_p = tuple(dst.on(axis) for axis in names)
    for placement in (*src_p, *dst_p):
        if placement.kind == "SS":
            raise ParallelizeError(
                f"{where}: {value.name!r} moves {placement} activations; the generic (DTensor) boundary "
                "supports R, S(d) and P(op) only"
            )
    for axis, a, b in zip(names, src_p, dst_p):
        if a.is_partial and a.op != "sum" and a != b:
            raise ParallelizeError(
                f"{where}: {value.name!r} goes {a} -> {b} on axis {axis!r}: DTensor gives every rank the "
                f"unscaled gradient of a {a} value, which is wrong; only P(sum) sources are supported here"
            )
    grad_src = tuple(_grad_placement(p, partial=False) for p in src_p)
    grad_dst = tuple(
        _grad_placement(p, partial=side == "in" and p.is_replicate and sharded.get(axis, False))
        for axis, p in zip(names, dst_p)
    )
    return DTensorMove(f"{where}: {value.name}", mesh, src_p, dst_p, grad_src, grad_dst)


class GenericBoundary:
    """What the generic form's ``forward`` calls: ``input(name, value)``, ``output(name, outputs, address)``."""

    def __init__(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
        self._inputs = dict(inputs)
        self._outputs = dict(outputs)

    def input(self, name: str, value: Any) -> Any:
        mover = self._inputs.get(name)
        return value if mover is None else mover(value)

    def output(self, name: str, outputs: Any, address: Address) -> Any:
        mover = self._outputs.get(name)
        if mover is None:
            return outputs
        return replace_output(outputs, address, mover(get_output(outputs, address)))

    def __deepcopy__(self, memo: dict) -> GenericBoundary:
        return self  # holds process-group handles, shared by copies of a model


def decision_movers(
    decision: EntryDecision, mesh: DeviceMesh, axes: Mapping[str, AxisCollectives], where: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Movers for every input and output of an entry's decision (its declared values and known inputs)."""
    entry, mesh_names = decision.entry, decision.mesh
    sharded = {axis: axis in decision.sharded_axes for axis in mesh_names}

    def movers(values: Any, layouts: Any, side: str) -> dict[str, Any]:
        return {
            value.name: mover_for(
                value, layouts(value.name, mesh_names), side=side, sharded=sharded, mesh=mesh, axes=axes, where=where
            )
            for value in values
        }

    return movers(decision.inputs, entry.input_layouts, "in"), movers(decision.outputs, entry.output_layouts, "out")


def boundary_movers(
    plan: Plan,
    key: str,
    mesh: DeviceMesh,
    axes: Mapping[str, AxisCollectives],
    where: str,
    *,
    known_inputs: tuple[str, ...] = (),
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Movers for every declared input and output of the entry ``key`` (and ``known_inputs``,
    see :func:`hpgen.core.transitions.value_ops`)."""
    return decision_movers(entry_decision(plan, key, known_inputs=known_inputs), mesh, axes, where)
