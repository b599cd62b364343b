"""A sharded parameter as state dicts see it, and the gather of its full tensor.

``parallelize`` records a :class:`ShardedParam` on each module owning a sharded parameter
(:mod:`hpgen.runtime.checkpoint.state_dict`): the parameter's full shape, this rank's
shard of it, and its DTensor form (:mod:`hpgen.runtime.shard_layout`). State dicts,
FSDP2's pieces (:mod:`hpgen.runtime.checkpoint.fsdp_state`), ``save_pretrained`` and
gradient clipping read it. :func:`gather_full` rebuilds the full tensor from every rank's
shard (collective on the plan's axes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.forward.handback import call
from hpgen.runtime.shard_layout import DTensorForm, PackedShard
from hpgen.core.shards import ShardLayout

__all__ = ["ShardedParam", "gather_full", "layout_text"]


@dataclass(frozen=True, eq=False)
class ShardedParam:
    """A sharded parameter as the state dict sees it: full shape, layout, DTensor form."""

    name: str  # one FQN, for messages
    shard_layout: ShardLayout  # the full shape, and (placement, rank, size) per plan axis in mesh order
    axes: tuple[str, ...]
    mesh: DeviceMesh | None  # the DTensor form's mesh: the plan's axes, RS axes unflattened (None: no form)
    groups: tuple[Any, ...]  # each axis's process group
    form: DTensorForm
    gathered: bool = False  # state_dict() gives the full tensor (peft's adapters), not a DTensor

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.shard_layout.shape

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.shard_layout.local_shape

    def __deepcopy__(self, memo: dict) -> ShardedParam:
        return self  # immutable, holds process groups: shared by copies of a model

    def to_dtensor(self, local: Tensor) -> DTensor:
        """``local`` (this rank's chunk) as a DTensor over the plan's axes.

        A view when the DTensor form is exact; otherwise (``tensor_split`` and ``chunk``
        differ) a copy laid out DTensor's way, which takes a gather over the plan's axes:
        then every rank must call ``state_dict()`` together, as DCP does.
        """
        form = self.form
        if form.placements is None:
            raise ParallelizeError(f"state_dict(): {self.name} ({layout_text(self)}): {form.problem}")
        shape = torch.Size(self.global_shape)
        stride = torch.empty(self.global_shape, device="meta").stride()
        if not form.exact:
            full = gather_full(local.detach(), self)
            local = distribute_tensor(full, self.mesh, form.chunked, src_data_rank=None).to_local()
            return DTensor.from_local(local, self.mesh, form.chunked, run_check=False, shape=shape, stride=stride)
        dtensor = DTensor.from_local(local, self.mesh, form.placements, run_check=False, shape=shape, stride=stride)
        if form.packed:
            dtensor.__class__ = PackedShard
        return dtensor

    def to_local(self, value: Any) -> Any:
        """What ``load_state_dict`` should copy into the local parameter for ``value``."""
        if isinstance(value, DTensor):
            if (
                self.form.exact
                and tuple(value.shape) == self.global_shape
                and value.device_mesh == self.mesh
                and tuple(value.placements) == self.form.placements
            ):
                return value.to_local()
            value = value.full_tensor()  # another layout: collective over its mesh
        if isinstance(value, Tensor) and tuple(value.shape) == self.global_shape != self.local_shape:
            return self.shard_layout.local_slice(value)
        return value  # the local shape already, or a size load_state_dict reports


def layout_text(param: ShardedParam) -> str:
    """Each plan axis's placement and size, for messages."""
    return ", ".join(f"{axis} {p} over {size}" for axis, (p, _, size) in zip(param.axes, param.shard_layout.shares))


def gather_full(local: Tensor, param: ShardedParam) -> Tensor:
    """The full tensor of ``param`` from every rank's ``local`` shard (all ranks of the plan's axes call it).

    Undoes the axes in reverse mesh order: on each, an all-gather of the (padded) pieces,
    each put back where :meth:`ShardLayout.pieces` says it came from (one range for ``S``,
    one per block for ``SS``; of the ``r`` equal pieces of an ``RS(d,r)`` chunk, the first).
    """
    layout = param.shard_layout
    tensor = local.contiguous()
    for axis in reversed(range(len(layout.shares))):
        placement, _, size = layout.shares[axis]
        if placement.is_replicate or size == 1:
            continue
        try:
            dim = layout.split_dim(axis)
            ranges = layout.pieces(axis)
        except ValueError as error:
            raise ParallelizeError(f"{param.name}: cannot gather: {error}") from None
        sizes = [sum(stop - start for start, stop in runs) for runs in ranges]
        pieces = _all_gather_uneven(tensor, dim, sizes, param.groups[axis])
        shape = list(tensor.shape)
        shape[dim] = layout.prefix(axis).local_shape[dim]
        tensor = tensor.new_empty(shape)
        placed: set[tuple[tuple[int, int], ...]] = set()
        for piece, runs in zip(pieces, ranges):
            if tuple(runs) in placed:
                continue  # a replica of a piece already in place (RS)
            placed.add(tuple(runs))
            position = 0
            for start, stop in runs:
                tensor.narrow(dim, start, stop - start).copy_(piece.narrow(dim, position, stop - start))
                position += stop - start
    return tensor


def _all_gather_uneven(tensor: Tensor, dim: int, sizes: Sequence[int], group: Any) -> list[Tensor]:
    """Every rank's ``tensor`` (``sizes[r]`` long on ``dim``), padded to the longest for the collective."""
    longest = max(sizes)
    padded = tensor
    if tensor.size(dim) < longest:
        shape = list(tensor.shape)
        shape[dim] = longest - tensor.size(dim)
        padded = torch.cat([tensor, tensor.new_zeros(shape)], dim)
    gathered = [torch.empty_like(padded) for _ in sizes]
    call(dist.all_gather, gathered, padded.contiguous(), group=group)
    return [piece.narrow(dim, 0, n) for piece, n in zip(gathered, sizes)]
