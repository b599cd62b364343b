"""A parameter's shard in DTensor's names: the torch side of :class:`hpgen.core.shards.ShardLayout`.

hpgen's placements follow docs/plan-format.md: ``S(d)`` splits like ``torch.tensor_split`` (the first
``n % k`` ranks hold one more), ``SS(d,k)`` gives each rank its ``S(d)`` chunk of each
of ``k`` packed blocks, and ``RS(d,r)`` is ``S(d)`` over ``size / r`` chunks, each held
by ``r`` consecutive ranks. The core's :class:`~hpgen.core.shards.ShardLayout` computes which
global ranges a rank holds; this module names them for DTensor.

DTensor's ``Shard(d)`` follows ``torch.chunk`` instead (every rank but the last holds
``ceil(n / k)``, trailing ranks may hold nothing), and ``_StridedShard(d, split_factor=k)``
chunks each of ``k`` blocks the same way. The two agree when ``k`` divides the size and,
for any size, on 2 ranks; they differ for e.g. 5 rows on 4 ranks (2,1,1,1 against
2,2,1,0). :func:`dtensor_form` gives the DTensor placements only when they describe
exactly the shard hpgen holds on every rank (then the shard is the DTensor's local
tensor), and otherwise says why not, so that the state dict lays out a copy DTensor's
way instead of describing rows the rank does not hold. :func:`dtensor_placement` and
:func:`hpgen_placement` are the one mapping between the two kinds of placement.

Pure functions of shapes, placements and mesh sizes: every rank reaches the same verdict.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement as DPlacement
from torch.distributed.tensor.placement_types import _StridedShard

from hpgen.core.placement import REPLICATE, Placement
from hpgen.core.shards import ShardLayout, normalize_dim

__all__ = ["DTensorForm", "PackedShard", "dtensor_form", "dtensor_placement", "hpgen_placement"]


def dtensor_placement(placement: Placement, ndim: int | None = None) -> DPlacement:
    """DTensor's name for ``placement``: ``R`` -> ``Replicate()``, ``S(d)`` -> ``Shard(d)``, ``SS(d,k)`` ->
    ``_StridedShard(d, split_factor=k)``, ``P(op)`` -> ``Partial(op)``.

    ``ndim``: count ``d`` from the front for a tensor of that many dims. ``RS(d,r)`` has no
    single DTensor placement (it is ``Shard`` and ``Replicate`` on an unflattened mesh:
    :func:`dtensor_form`), so it raises, as any other placement does.
    """
    dim = placement.dim
    if dim is not None and ndim is not None:
        dim = normalize_dim(dim, ndim)
    if placement.is_replicate:
        return Replicate()
    if placement.is_shard:
        return Shard(dim)
    if placement.kind == "SS":
        return _StridedShard(dim, split_factor=placement.blocks)
    if placement.is_partial:
        return Partial(placement.op)
    raise ValueError(f"{placement} has no DTensor placement here")


def hpgen_placement(placement: DPlacement) -> Placement:
    """The hpgen placement of a DTensor placement: the inverse of :func:`dtensor_placement`."""
    if isinstance(placement, _StridedShard):
        return Placement("SS", dim=placement.dim, blocks=int(placement.split_factor))
    if isinstance(placement, Shard):
        return Placement("S", dim=placement.dim)
    if isinstance(placement, Partial):
        return Placement("P", op=placement.reduce_op)
    return REPLICATE


@dataclass(frozen=True)
class DTensorForm:
    """The DTensor placements of a parameter, one per mesh dim, and whether they are exact.

    ``exact``: the placements hold, on every rank, exactly the elements hpgen's shard holds,
    so the shard itself is the DTensor's local tensor. Otherwise ``problem`` says why, and
    ``chunked`` are placements (``SS`` as ``Shard``) for a copy laid out DTensor's way.
    ``split[i]`` is ``r`` when plan axis ``i`` holds ``RS(d,r)``: DTensor sees that axis as
    two mesh dims, ``size / r`` chunks (``Shard(d)``) times ``r`` replicas (``Replicate()``),
    and the state dict builds that mesh (``DeviceMesh._unflatten``).
    """

    placements: tuple[DPlacement, ...] | None
    exact: bool = True
    problem: str | None = None
    packed: bool = False  # the shard is several blocks of the full tensor (SS)
    split: tuple[int | None, ...] = ()
    chunked: tuple[DPlacement, ...] | None = None


def _as_chunks(placement: Placement, size: int) -> tuple[Placement, int, int | None]:
    """``RS(d,r)`` on ``size`` ranks as what DTensor sees: ``S(d)`` on ``size / r`` chunks (r replicas each)."""
    if placement.kind != "RS":
        return placement, size, None
    if placement.replicas == 1:
        return Placement("S", dim=placement.dim), size, None  # one rank a chunk: S(d)
    if placement.replicas >= size:
        return REPLICATE, size, None  # one chunk, on every rank
    return Placement("S", dim=placement.dim), size // placement.replicas, placement.replicas


@functools.lru_cache(maxsize=4096)
def dtensor_form(shape: tuple[int, ...], layout: tuple[Placement, ...], sizes: tuple[int, ...]) -> DTensorForm:
    """DTensor placements that hold, on every mesh coordinate, the same elements as hpgen's.

    ``layout[i]`` is the placement on plan axis ``i`` (of ``sizes[i]`` ranks). ``S(d)`` maps
    to ``Shard(d)``, ``SS(d,k)`` to ``_StridedShard(d, split_factor=k)``, ``RS(d,r)`` to
    ``Shard(d)`` and ``Replicate()`` on the axis unflattened into chunks and replicas, and
    ``R`` to ``Replicate()``; checked dim by dim against DTensor's chunk semantics for all
    coordinates (:meth:`ShardLayout.indices` read both ways). Whole-unit and block placements
    (``S(d,u,g)``, ``B``) have no DTensor name: their form is ``Shard(d)``, exact only where it
    holds the same elements (:func:`_whole_units_form`).
    """
    ndim = len(shape)
    for placement in layout:
        if placement.kind not in ("R", "S", "SS", "RS", "B"):
            return DTensorForm(None, False, f"{placement} has no DTensor form")
    if any(placement.whole_units for placement in layout):
        return _whole_units_form(shape, layout, sizes)
    seen = [_as_chunks(p, n) for p, n in zip(layout, sizes)]
    layout = tuple(p for p, _, _ in seen)
    sizes = tuple(n for _, n, _ in seen)
    split = tuple(r for _, _, r in seen)
    placements: list[DPlacement] = []
    for placement, replicas in zip(layout, split):
        placements.append(dtensor_placement(placement, ndim))
        if replicas is not None:
            placements.append(Replicate())
    chunked = tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)
    packed = any(p.kind == "SS" for p in layout)
    whole = ShardLayout.of(shape, layout, [0] * len(layout), sizes)

    def inexact(problem: str) -> DTensorForm:
        return DTensorForm(tuple(placements), False, problem, packed, split, chunked)

    for dim in range(ndim):
        sharding = [i for i in range(len(layout)) if whole.split_dim(i) == dim]
        if not sharding:
            continue
        if len(sharding) > 1 and any(layout[i].kind == "SS" for i in sharding):
            return inexact(f"dim {dim} is sharded by SS and another axis, which DTensor orders differently")
        for coordinate in itertools.product(*(range(sizes[i]) for i in sharding)):
            at = whole
            for i, c in zip(sharding, coordinate):
                at = at.at(i, c)
            ours, theirs = at.indices(dim), at.indices(dim, chunked=True)
            if ours != theirs:
                axes_text = ", ".join(f"{layout[i]} over {sizes[i]}" for i in sharding)
                return inexact(
                    f"dim {dim} of size {shape[dim]} ({axes_text}) splits like torch.tensor_split in hpgen "
                    f"(coordinate {tuple(coordinate)} holds {_describe(ours)}) but like torch.chunk in "
                    f"DTensor ({_describe(theirs)})"
                )
    return DTensorForm(tuple(placements), True, None, packed, split, chunked)


def _whole_units_form(shape: tuple[int, ...], layout: tuple[Placement, ...], sizes: tuple[int, ...]) -> DTensorForm:
    """The form of a layout with whole-unit or block placements, which DTensor has no name for:
    ``Shard(d)`` in their place, exact only where it holds the same elements on every rank
    (8 heads on 2 ranks), else a copy laid out that way (7 heads: 4 and 3 against 4 and 4)."""
    facing = tuple(Placement("S", dim=p.dim) if p.whole_units else p for p in layout)
    form = dtensor_form(shape, facing, sizes)
    if form.placements is None:
        return form
    for coordinate in itertools.product(*(range(size) for size in sizes)):
        ours = ShardLayout.of(shape, layout, coordinate, sizes)
        theirs = ShardLayout.of(shape, facing, coordinate, sizes)
        for dim in range(len(shape)):
            if ours.indices(dim) != theirs.indices(dim, chunked=True):
                placements = ", ".join(str(p) for p in layout if p.whole_units)
                problem = (
                    f"{placements} has no DTensor placement; Shard({dim}) holds other elements at coordinate "
                    f"{coordinate} ({_describe(ours.indices(dim))} against {_describe(theirs.indices(dim, chunked=True))})"
                )
                return DTensorForm(form.placements, False, problem, form.packed, form.split, form.chunked)
    return DTensorForm(form.placements, True, None, form.packed, form.split, form.chunked)


def _describe(indices: list[int]) -> str:
    if not indices:
        return "nothing"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"[{indices[0]}, {indices[-1] + 1})"
    return f"{len(indices)} indices from {indices[0]}"


class PackedShard(DTensor):
    """A DTensor whose local tensor is several blocks of the full tensor (``SS``: one per packed block).

    Its placements are ``_StridedShard``, right for DTensor ops (``full_tensor``,
    ``redistribute``), but DCP writes one chunk per DTensor from its first offset, which
    for a strided shard overlaps the others. These methods of DCP's checkpointable
    protocol give it each block instead (offsets in the full tensor, views of the local).
    """

    __slots__ = ()

    def _hp_blocks(self) -> list[tuple[torch.Size, torch.Size, Tensor]]:
        local = self._local_tensor
        mesh = self.device_mesh
        coordinate = mesh.get_coordinate()
        placements = [hpgen_placement(placement) for placement in self.placements]
        sizes = [mesh.size(mesh_dim) for mesh_dim in range(mesh.ndim)]
        layout = ShardLayout.of(tuple(self.shape), placements, coordinate, sizes)
        return [(torch.Size(box.offsets), torch.Size(box.sizes), box.local_view(local)) for box in layout.boxes()]

    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties.create_from_tensor(self._local_tensor)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes), properties=properties, size=self.size()
                ),
            )
            for offsets, sizes, _ in self._hp_blocks()
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in self._hp_blocks()]

    def __get_tensor_shard__(self, index: Any) -> Tensor:
        for offsets, _, view in self._hp_blocks():
            if offsets == index.offset:
                return view
        raise ValueError(f"PackedShard: no block at offset {index.offset}")
