"""Where a rank's shard of a planned parameter lies in the full tensor, and its DTensor name.

hpgen's placements follow docs/plan-format.md: ``S(d)`` splits like ``torch.tensor_split`` (the first
``n % k`` ranks hold one more) and ``SS(d,k)`` gives each rank its ``S(d)`` chunk of each
of ``k`` packed blocks. :func:`dim_runs` says, per tensor dim, which global index ranges
this rank holds and in what order (one range for ``S``, one per block for ``SS``); a
checkpoint reader reads those boxes and a DCP writer names them.

``RS(d,r)`` is ``S(d)`` over ``size / r`` chunks, each held by ``r`` consecutive ranks.

DTensor's ``Shard(d)`` follows ``torch.chunk`` instead (every rank but the last holds
``ceil(n / k)``, trailing ranks may hold nothing), and ``_StridedShard(d, split_factor=k)``
chunks each of ``k`` blocks the same way. The two agree when ``k`` divides the size and,
for any size, on 2 ranks; they differ for e.g. 5 rows on 4 ranks (2,1,1,1 against
2,2,1,0). :func:`dtensor_form` gives the DTensor placements only when they describe
exactly the shard hpgen holds on every rank (then the shard is the DTensor's local
tensor), and otherwise says why not, so that the state dict lays out a copy DTensor's
way instead of describing rows the rank does not hold.

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
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement as DPlacement
from torch.distributed.tensor.placement_types import _StridedShard

from hpgen.placement import REPLICATE, Placement
from hpgen.shards import AxisShare, chunk_bounds, chunks_and_index, normalize_dim, split_bounds

__all__ = ["Box", "DTensorForm", "PackedShard", "boxes", "dim_runs", "dtensor_form", "hpgen_indices", "dtensor_indices"]

Run = tuple[int, int]
"""A ``[start, stop)`` range of global indices along one dim."""


def _take(runs: list[Run], lo: int, hi: int) -> list[Run]:
    """The global ranges of local positions ``[lo, hi)`` of the concatenation of ``runs``."""
    taken: list[Run] = []
    position = 0
    for start, stop in runs:
        length = stop - start
        a, b = max(lo, position), min(hi, position + length)
        if a < b:
            piece = (start + a - position, start + b - position)
            if taken and taken[-1][1] == piece[0]:
                taken[-1] = (taken[-1][0], piece[1])  # adjacent: one read, one chunk
            else:
                taken.append(piece)
        position += length
    return taken


def dim_runs(shape: Sequence[int], shares: Sequence[AxisShare]) -> list[list[Run]]:
    """Per dim of a tensor of ``shape``, the global ranges this rank holds, in local order.

    Follows :func:`hpgen.runtime.sharding.local_chunk` exactly: axes apply in mesh order,
    each splitting what the previous ones left.
    """
    runs: list[list[Run]] = [[(0, n)] for n in shape]
    for placement, rank, size in shares:
        if placement.kind == "R":
            continue
        if placement.kind not in ("S", "SS", "RS"):
            raise ValueError(f"no shard layout for placement {placement} (only R, S(d), SS(d,k), RS(d,r))")
        dim = normalize_dim(placement.dim, len(shape))
        total = sum(stop - start for start, stop in runs[dim])
        if placement.kind in ("S", "RS"):
            chunks, index = chunks_and_index(placement, rank, size)
            runs[dim] = _take(runs[dim], *split_bounds(total, chunks, index))
        else:
            block = total // placement.blocks
            lo, hi = split_bounds(block, size, rank)
            pieces: list[Run] = []
            for j in range(placement.blocks):
                for piece in _take(runs[dim], j * block + lo, j * block + hi):
                    if pieces and pieces[-1][1] == piece[0]:
                        pieces[-1] = (pieces[-1][0], piece[1])
                    else:
                        pieces.append(piece)
            runs[dim] = pieces
    return runs


@dataclass(frozen=True)
class Box:
    """One contiguous block of the full tensor held by this rank.

    ``offsets``/``sizes`` are in the full tensor; ``local_offsets`` where the block sits in
    the rank's local tensor.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]

    def bounds(self) -> tuple[tuple[int, int], ...]:
        """``[start, stop)`` per dim in the full tensor (the box a checkpoint reader reads)."""
        return tuple((o, o + s) for o, s in zip(self.offsets, self.sizes))

    def global_index(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.bounds())

    def local_view(self, local: torch.Tensor) -> torch.Tensor:
        view = local
        for dim, (o, s) in enumerate(zip(self.local_offsets, self.sizes)):
            view = view.narrow(dim, o, s)
        return view


def boxes(shape: Sequence[int], shares: Sequence[AxisShare]) -> list[Box]:
    """Every contiguous block of the full tensor that this rank's shard is made of."""
    per_dim = []
    for runs in dim_runs(shape, shares):
        placed, position = [], 0
        for start, stop in runs:
            placed.append((start, stop - start, position))
            position += stop - start
        per_dim.append(placed or [(0, 0, 0)])
    found = []
    for combo in itertools.product(*per_dim):
        found.append(Box(tuple(c[0] for c in combo), tuple(c[1] for c in combo), tuple(c[2] for c in combo)))
    return found


# --------------------------------------------------------------------------- the DTensor form


def hpgen_indices(
    n: int, placements: Sequence[Placement], sizes: Sequence[int], coordinate: Sequence[int]
) -> list[int]:
    """The global indices of one dim of size ``n`` that hpgen gives mesh ``coordinate``.

    ``placements[i]`` is axis ``i``'s placement of this dim (``R`` when it does not shard it).
    """
    index = list(range(n))
    for placement, size, rank in zip(placements, sizes, coordinate):
        if placement.kind in ("S", "RS"):
            lo, hi = split_bounds(len(index), *chunks_and_index(placement, rank, size))
            index = index[lo:hi]
        elif placement.kind == "SS":
            block = len(index) // placement.blocks
            lo, hi = split_bounds(block, size, rank)
            index = [i for j in range(placement.blocks) for i in index[j * block + lo : j * block + hi]]
    return index


def _chunk(values: list[int], k: int, rank: int) -> list[int]:
    """``torch.chunk`` semantics: pieces of ``ceil(n / k)``; ranks past the end get nothing."""
    lo, hi = chunk_bounds(len(values), k, rank)
    return values[lo:hi]


def dtensor_indices(
    n: int, placements: Sequence[Placement], sizes: Sequence[int], coordinate: Sequence[int]
) -> list[int]:
    """The global indices of one dim that DTensor gives ``coordinate`` for the placements
    :func:`dtensor_form` maps ``placements`` to (``Shard``: chunk; ``_StridedShard``: chunk of
    each block). ``tests/runtime`` checks this against DTensor itself."""
    index = list(range(n))
    for placement, size, rank in zip(placements, sizes, coordinate):
        if placement.kind == "S":
            index = _chunk(index, size, rank)
        elif placement.kind == "SS":
            block = len(index) // placement.blocks
            index = [i for j in range(placement.blocks) for i in _chunk(index[j * block : (j + 1) * block], size, rank)]
    return index


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


def _to_dtensor_placement(placement: Placement, ndim: int) -> DPlacement:
    if placement.kind in ("S", "RS"):
        return Shard(normalize_dim(placement.dim, ndim))
    if placement.kind == "SS":
        return _StridedShard(normalize_dim(placement.dim, ndim), split_factor=placement.blocks)
    return Replicate()


def _as_chunks(placement: Placement, size: int) -> tuple[Placement, int, int | None]:
    """``RS(d,r)`` on ``size`` ranks as what DTensor sees: ``S(d)`` on ``size / r`` chunks (r replicas each)."""
    if placement.kind != "RS" or placement.replicas == 1:
        return placement, size, None
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
    coordinates.
    """
    ndim = len(shape)
    for placement in layout:
        if placement.kind not in ("R", "S", "SS", "RS"):
            return DTensorForm(None, False, f"{placement} has no DTensor form")
    seen = [_as_chunks(p, n) for p, n in zip(layout, sizes)]
    layout = tuple(p for p, _, _ in seen)
    sizes = tuple(n for _, n, _ in seen)
    split = tuple(r for _, _, r in seen)
    placements: list[DPlacement] = []
    for placement, replicas in zip(layout, split):
        placements.append(_to_dtensor_placement(placement, ndim))
        if replicas is not None:
            placements.append(Replicate())
    chunked = tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)
    packed = any(p.kind == "SS" for p in layout)

    def inexact(problem: str) -> DTensorForm:
        return DTensorForm(tuple(placements), False, problem, packed, split, chunked)

    for dim in range(ndim):
        on_dim = [p if p.kind in ("S", "SS") and normalize_dim(p.dim, ndim) == dim else REPLICATE for p in layout]
        sharding = [i for i, p in enumerate(on_dim) if p.kind != "R"]
        if not sharding:
            continue
        if len(sharding) > 1 and any(on_dim[i].kind == "SS" for i in sharding):
            return inexact(f"dim {dim} is sharded by SS and another axis, which DTensor orders differently")
        for coordinate in itertools.product(*(range(sizes[i]) for i in sharding)):
            full = [0] * len(layout)
            for i, c in zip(sharding, coordinate):
                full[i] = c
            ours = hpgen_indices(shape[dim], on_dim, sizes, full)
            theirs = dtensor_indices(shape[dim], on_dim, sizes, full)
            if ours != theirs:
                axes_text = ", ".join(f"{layout[i]} over {sizes[i]}" for i in sharding)
                return inexact(
                    f"dim {dim} of size {shape[dim]} ({axes_text}) splits like torch.tensor_split in hpgen "
                    f"(coordinate {tuple(coordinate)} holds {_describe(ours)}) but like torch.chunk in "
                    f"DTensor ({_describe(theirs)})"
                )
    return DTensorForm(tuple(placements), True, None, packed, split, chunked)


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
        shares = []
        for mesh_dim, placement in enumerate(self.placements):
            size = mesh.size(mesh_dim)
            shares.append((_hp_placement(placement), coordinate[mesh_dim], size))
        return [
            (torch.Size(box.offsets), torch.Size(box.sizes), box.local_view(local))
            for box in boxes(tuple(self.shape), shares)
        ]

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


def _hp_placement(placement: Any) -> Placement:
    """The hpgen placement a DTensor placement of :func:`dtensor_form` came from."""
    if isinstance(placement, _StridedShard):
        return Placement("SS", dim=placement.dim, blocks=int(placement.split_factor))
    if isinstance(placement, Shard):
        return Placement("S", dim=placement.dim)
    return REPLICATE
