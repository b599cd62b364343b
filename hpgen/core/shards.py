"""Shard arithmetic of the plan's placements, shared by the planner and the runtime.

``S(d)`` splits dim ``d`` like ``torch.tensor_split`` (the first ``n % k`` ranks hold one
more element); ``S(d,u)`` does the same over whole units of ``u`` elements (whole heads:
the first ranks hold one more head); ``S(d,u,g)`` cuts dim ``d`` into ``g`` equal groups,
the axis into ``g`` consecutive sets of ``size / g`` ranks, and set ``j`` cuts group ``j``
in whole units; ``SS(d,k)`` cuts dim ``d`` into ``k`` equal packed blocks (a fused
``gate_up_proj``) and gives each rank its ``S(d)`` chunk of every block, concatenated in
block order; ``RS(d,r)`` cuts dim ``d`` into ``size / r`` chunks (``tensor_split`` again)
and gives rank ``i`` chunk ``i // r``, so ``r`` consecutive ranks hold each chunk;
``B(d, n1:P1, ...)`` gives each rank its piece of every block (by the block's own
placement), concatenated in block order. A layout over several mesh axes applies them in
mesh order, each axis splitting what the previous ones left. DTensor's ``Shard`` and
FSDP2 follow ``torch.chunk`` instead (pieces of ``ceil(n / k)``, trailing ranks may get
nothing): :func:`chunk_bounds` is that one.

:class:`ShardLayout` is a parameter's shard on one rank (full shape, and per mesh axis
the placement, the rank's index and the axis size): its local shape, the global ranges
it holds per dim, the contiguous boxes they make, and the local slice of a full tensor
all come from one walk over the axes (:func:`_axis_step`, whose :func:`held_positions`
is the only place that tells the placements apart). The runtime's
:mod:`hpgen.runtime.shard_layout` adds the DTensor names of a layout and back.

Pure integer functions (no torch at import time; tensors are only handed in, and used by
their methods), so the planner's sizing report and the runtime's sharding compute the
same sizes from one place (docs/plan-format.md).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hpgen.core.placement import Placement

__all__ = [
    "AxisShare",
    "Box",
    "Run",
    "ShardLayout",
    "chunk_bounds",
    "chunk_sizes",
    "block_ranges",
    "blocks_problem",
    "chunks_and_index",
    "held_positions",
    "normalize_dim",
    "placement_problem",
    "row_heads",
    "split_bounds",
    "split_sizes",
]

AxisShare = tuple[Placement, int, int]
"""One mesh axis as a parameter sees it: (placement, this rank's index, axis size)."""

Run = tuple[int, int]
"""A ``[start, stop)`` range of global indices along one dim."""

T = TypeVar("T")


def split_sizes(n: Any, k: int) -> tuple[Any, ...]:
    """Sizes of ``torch.tensor_split`` of ``n`` elements into ``k`` parts: the first ``n % k`` get one more.

    ``ceil((n - i) / k)``, written without a comparison, so that a symbolic ``n``
    (torch.compile with dynamic shapes) gives symbolic sizes instead of a guard on ``n % k``.
    """
    return tuple((n + k - 1 - i) // k for i in range(k))


def split_bounds(n: int, k: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``rank`` of ``torch.tensor_split`` of ``n`` into ``k``."""
    sizes = split_sizes(n, k)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def chunk_bounds(n: int, k: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of piece ``rank`` of ``torch.chunk`` of ``n`` into ``k`` (DTensor's ``Shard``,
    FSDP2's ``_chunk_with_empty``): pieces of ``ceil(n / k)``, ranks past the end get nothing."""
    step = -(-n // k) if n else 0
    return min(rank * step, n), min((rank + 1) * step, n)


def chunk_sizes(n: int, k: int) -> tuple[int, ...]:
    """Sizes of ``torch.chunk`` of ``n`` into ``k``, zero for the ranks past the end."""
    return tuple(hi - lo for lo, hi in (chunk_bounds(n, k, rank) for rank in range(k)))


def normalize_dim(dim: int, ndim: int) -> int | None:
    """``dim`` counted from the front, or ``None`` when a tensor of ``ndim`` dims has no such dim."""
    return dim % ndim if -ndim <= dim < ndim else None


def chunks_and_index(placement: Placement, rank: int, size: int) -> tuple[int, int]:
    """``(number of chunks, the chunk this rank holds)`` of an ``S`` or ``RS`` placement."""
    if placement.kind == "RS":
        return size // placement.replicas, rank // placement.replicas
    return size, rank


def placement_problem(shape: Sequence[int], placement: Placement, size: int) -> str | None:
    """Why a parameter of ``shape`` cannot take ``placement`` on an axis of ``size`` ranks, or None."""
    if placement.is_partial:
        return f"a parameter cannot be partial ({placement}): parameters hold values, not sums"
    if placement.kind in ("S", "SS", "RS", "B"):
        dim = normalize_dim(placement.dim, len(shape))
        if dim is None:
            return f"{placement} names dim {placement.dim}, but the parameter has shape {tuple(shape)}"
        n = shape[dim]
        if placement.kind == "SS" and n % placement.blocks:
            return f"{placement} cuts dim {dim} of size {n} into {placement.blocks} packed blocks, which does not divide"
        if placement.kind == "RS" and size % placement.replicas:
            return (
                f"{placement} puts each chunk on {placement.replicas} ranks, which does not divide the axis "
                f"size {size}"
            )
        if placement.kind == "S" and placement.whole_units:
            return _units_problem(n, dim, placement, size)
        if placement.kind == "B":
            total = sum(block for block, _ in placement.parts)
            if total != n:
                return f"{placement}'s blocks add up to {total}, but dim {dim} has size {n}"
            for index, (block, inner) in enumerate(placement.parts):
                inner_shape = (*shape[:dim], block, *shape[dim + 1 :])
                problem = placement_problem(inner_shape, inner, size)
                if problem is not None:
                    return f"block {index} ({block}:{inner}) of {placement}: {problem}"
    return None


def _units_problem(n: int, dim: int, placement: Placement, size: int) -> str | None:
    """Why ``S(d,u,g)`` cannot cut dim ``dim`` of size ``n`` over ``size`` ranks: groups or units that do
    not divide, or a rank left with no unit (no head)."""
    unit, groups = placement.unit, placement.groups
    if size % groups:
        return f"{placement} cuts the axis of size {size} into {groups} sets of ranks, which does not divide"
    if n % groups:
        return f"{placement} cuts dim {dim} of size {n} into {groups} groups, which does not divide"
    group = n // groups
    if group % unit:
        where = f"its groups of {group}" if groups > 1 else f"dim {dim} of size {n}"
        return f"{placement} cuts in whole units of {unit}, which do not divide {where}"
    units, ranks = group // unit, size // groups
    if units < ranks:
        if groups > 1:
            return (
                f"{placement}: each of the {groups} groups holds {units} units of {unit} for its {ranks} ranks, so "
                f"a rank would hold none (no head): at most {units * groups} ranks"
            )
        return (
            f"{placement}: dim {dim} holds {units} units of {unit}, fewer than the {size} ranks, so a rank would "
            f"hold none (no head): at most {units} ranks"
        )
    return None


def held_positions(total: int, placement: Placement, rank: int, size: int, chunked: bool = False) -> list[Run]:
    """The ``[start, stop)`` positions of a dim of ``total`` elements that rank ``rank`` of an axis of
    ``size`` keeps under ``placement``, in the order its shard holds them.

    The one place that tells ``R``, ``S`` (plain, in units, in groups), ``RS``, ``SS`` and ``B``
    apart. ``chunked``: DTensor's reading (``torch.chunk`` pieces) instead of hpgen's
    (``torch.tensor_split``); DTensor has no whole-unit shard, so ``S(d,u,g)`` reads as its ``Shard(d)``.
    """
    bounds = chunk_bounds if chunked else split_bounds
    kind = placement.kind
    if kind == "R":
        return [(0, total)]
    if kind == "S" and placement.whole_units and not chunked:
        per_set = size // placement.groups
        group_index, index = divmod(rank, per_set)
        group = total // placement.groups
        lo, hi = split_bounds(group // placement.unit, per_set, index)
        start = group_index * group
        return [(start + lo * placement.unit, start + hi * placement.unit)]
    if kind in ("S", "RS"):
        chunks, index = chunks_and_index(placement, rank, size)
        return [bounds(total, chunks, index)]
    if kind == "SS":
        block = total // placement.blocks
        lo, hi = bounds(block, size, rank)
        return [(j * block + lo, j * block + hi) for j in range(placement.blocks)]
    if kind == "B":
        found, offset = [], 0
        for block, inner in placement.parts:
            found += [(offset + a, offset + b) for a, b in held_positions(block, inner, rank, size, chunked)]
            offset += block
        return found
    raise ValueError(f"no shard layout for placement {placement} (only R, S, SS, RS and B)")


def block_ranges(placement: Placement) -> list[tuple[Run, Placement]]:
    """``B(d, ...)``'s blocks: each one's ``[start, stop)`` along its dim and its placement."""
    found, offset = [], 0
    for block, inner in placement.parts:
        found.append(((offset, offset + block), inner))
        offset += block
    return found


# --------------------------------------------------------------------------- the walk over the axes


def _take(runs: Sequence[Run], lo: int, hi: int) -> list[Run]:
    """The global ranges of local positions ``[lo, hi)`` of the concatenation of ``runs``.

    Nothing taken gives one empty run at the global place of position ``lo``, so that a
    rank holding none of a dim still has a place in it (an empty vocab range starts there).
    """
    taken: list[Run] = []
    position = 0
    place = None
    for start, stop in runs:
        length = stop - start
        if place is None and lo <= position + length:
            place = start + lo - position
        a, b = max(lo, position), min(hi, position + length)
        if a < b:
            taken.append((start + a - position, start + b - position))
        position += length
    return _joined([taken], place if place is not None else 0)


def _joined(pieces: Iterable[Sequence[Run]], place: int) -> list[Run]:
    """``pieces`` in order, empty runs dropped and adjacent runs merged (one read, one box), or
    one empty run at ``place`` when nothing is left."""
    joined: list[Run] = []
    for start, stop in itertools.chain.from_iterable(pieces):
        if start == stop:
            continue
        if joined and joined[-1][1] == start:
            joined[-1] = (joined[-1][0], stop)
        else:
            joined.append((start, stop))
    return joined or [(place, place)]


def _axis_step(runs: Sequence[Run], placement: Placement, rank: int, size: int, chunked: bool) -> list[Run]:
    """What rank ``rank`` of an axis of ``size`` laid out as ``placement`` keeps of the dim held as ``runs``.

    ``chunked``: DTensor's reading (``torch.chunk`` pieces) instead of hpgen's (``torch.tensor_split``).
    """
    total = sum(stop - start for start, stop in runs)
    taken = [_take(runs, lo, hi) for lo, hi in held_positions(total, placement, rank, size, chunked)]
    return _joined(taken, taken[0][0][0] if taken else 0)


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

    def full_view(self, full: T) -> T:
        """The block as a view of the full tensor ``full``."""
        return _narrowed(full, self.offsets, self.sizes)

    def local_view(self, local: T) -> T:
        """The block as a view of the rank's local tensor ``local``."""
        return _narrowed(local, self.local_offsets, self.sizes)


def _narrowed(tensor: Any, offsets: Sequence[int], sizes: Sequence[int]) -> Any:
    for dim, (o, s) in enumerate(zip(offsets, sizes)):
        tensor = tensor.narrow(dim, o, s)
    return tensor


@dataclass(frozen=True)
class ShardLayout:
    """A parameter's shard on one rank: its full ``shape`` and, per mesh axis in mesh order, the
    placement, this rank's index on the axis and the axis size (``shares``).

    Axes apply in mesh order, each splitting what the ones before it left. Everything
    hpgen needs of a shard comes from here: the local shape, the global ranges held per dim
    (:meth:`runs`), the boxes a checkpoint reader reads (:meth:`boxes`), the local slice of a
    full tensor (:meth:`local_slice`) and, per axis, every rank's piece for a gather
    (:meth:`pieces`). Placements are checked beforehand (:func:`placement_problem`).
    """

    shape: tuple[int, ...]
    shares: tuple[AxisShare, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "shares", tuple(self.shares))

    @classmethod
    def of(
        cls, shape: Sequence[int], placements: Sequence[Placement], coordinate: Sequence[int], sizes: Sequence[int]
    ) -> ShardLayout:
        """The layout of ``shape`` at mesh ``coordinate``, ``placements[i]`` on axis ``i`` of ``sizes[i]`` ranks."""
        return cls(tuple(shape), tuple(zip(placements, coordinate, sizes)))

    @property
    def placements(self) -> tuple[Placement, ...]:
        return tuple(placement for placement, _, _ in self.shares)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(size for _, _, size in self.shares)

    @property
    def sharded(self) -> bool:
        """Some axis lays it out other than replicated (the shard may still be whole, on axes of one rank)."""
        return any(not placement.is_replicate for placement in self.placements)

    def split_dim(self, axis: int) -> int | None:
        """The dim axis number ``axis`` splits (counted from the front), or None when it replicates."""
        placement = self.shares[axis][0]
        if placement.is_replicate or placement.dim is None:
            return None
        dim = normalize_dim(placement.dim, len(self.shape))
        if dim is None:
            raise ValueError(f"{placement} names dim {placement.dim}, but the shape is {self.shape}")
        return dim

    def prefix(self, axes: int) -> ShardLayout:
        """The shard the first ``axes`` axes leave (what the next axis splits)."""
        return ShardLayout(self.shape, self.shares[:axes])

    def at(self, axis: int, rank: int) -> ShardLayout:
        """The same layout at index ``rank`` of axis number ``axis``, the other coordinates kept."""
        placement, _, size = self.shares[axis]
        return ShardLayout(self.shape, (*self.shares[:axis], (placement, rank, size), *self.shares[axis + 1 :]))

    @functools.cached_property
    def _runs(self) -> tuple[tuple[Run, ...], ...]:
        return self._walk(chunked=False)

    def _walk(self, *, chunked: bool) -> tuple[tuple[Run, ...], ...]:
        """Per dim, the runs held (an empty dim keeps one empty run at its place)."""
        runs: list[list[Run]] = [[(0, n)] for n in self.shape]
        for axis, (placement, rank, size) in enumerate(self.shares):
            dim = self.split_dim(axis)
            if dim is not None:
                runs[dim] = _axis_step(runs[dim], placement, rank, size, chunked)
        return tuple(tuple(r) for r in runs)

    def runs(self, *, chunked: bool = False) -> list[list[Run]]:
        """Per dim, the global ranges this rank holds, in local order (empty ranges left out).

        ``chunked``: the ranges DTensor would give this rank for the same placements
        (``torch.chunk`` pieces; ``SS`` as ``_StridedShard``).
        """
        walked = self._walk(chunked=True) if chunked else self._runs
        return [[(a, b) for a, b in dim if a < b] for dim in walked]

    def indices(self, dim: int, *, chunked: bool = False) -> list[int]:
        """The global indices of ``dim`` this rank holds, in local order."""
        return [i for start, stop in self.runs(chunked=chunked)[dim] for i in range(start, stop)]

    @functools.cached_property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's chunk."""
        return tuple(sum(stop - start for start, stop in dim) for dim in self._runs)

    def range(self, dim: int) -> Run:
        """``[start, stop)`` of the global indices of ``dim`` this rank holds (an empty one where it
        holds none): what a vocab-parallel embedding needs to know which token ids are its own."""
        held = self._runs[dim]
        if len(held) > 1:
            raise ValueError(f"dim {dim} of this shard is {len(held)} ranges ({self}), not one")
        return held[0]

    def held_count(self, dim: int, start: int, stop: int) -> int:
        """How many of the global indices ``[start, stop)`` of ``dim`` this rank holds."""
        return sum(max(0, min(stop, b) - max(start, a)) for a, b in self._runs[dim])

    def block_pieces(self, axis: int) -> list[tuple[Placement, Run]]:
        """For a ``B`` placement on axis number ``axis``: each block's placement and the ``[start, stop)``
        of the rank's local dim holding its piece (empty where it holds none of the block).

        The blocks are positions of the full dim, so ``B`` must be the only axis splitting it
        (:func:`blocks_problem`).
        """
        placement = self.shares[axis][0]
        dim = self.split_dim(axis)
        if placement.kind != "B" or dim is None:
            raise ValueError(f"axis {axis} of {self} is not a B placement")
        found, position = [], 0
        for (lo, hi), inner in block_ranges(placement):
            count = self.held_count(dim, lo, hi)
            found.append((inner, (position, position + count)))
            position += count
        return found

    def replicated_blocks(self) -> list[tuple[int, int, int, int, int]]:
        """The replicated blocks of each ``B`` placement, where they lie in this rank's shard and how many
        consecutive ranks of their axis hold each: ``(axis, dim, start, stop, replicas)``.

        ``R`` blocks are held by the whole axis, ``RS(d,r)`` ones by their ``r`` replicas; adjacent
        blocks held alike merge (Falcon's key and value rows: one gradient reduction). What the
        runtime sums a ``B`` parameter's gradient over, and what the planner's report counts.
        """
        found: list[tuple[int, int, int, int, int]] = []
        for axis, (placement, _, size) in enumerate(self.shares):
            if placement.kind != "B" or size == 1:
                continue
            dim = self.split_dim(axis)
            assert dim is not None
            for inner, (start, stop) in self.block_pieces(axis):
                replicas = size if inner.is_replicate else inner.replicas if inner.kind == "RS" else None
                if replicas is None or replicas == 1 or start == stop:
                    continue
                if found and found[-1][:2] == (axis, dim) and found[-1][3] == start and found[-1][4] == replicas:
                    found[-1] = (axis, dim, found[-1][2], stop, replicas)
                else:
                    found.append((axis, dim, start, stop, replicas))
        return found

    def boxes(self) -> list[Box]:
        """Every contiguous block of the full tensor that this rank's shard is made of."""
        per_dim = []
        for runs in self.runs():
            placed, position = [], 0
            for start, stop in runs:
                placed.append((start, stop - start, position))
                position += stop - start
            per_dim.append(placed or [(0, 0, 0)])
        return [
            Box(tuple(c[0] for c in combo), tuple(c[1] for c in combo), tuple(c[2] for c in combo))
            for combo in itertools.product(*per_dim)
        ]

    def local_slice(self, full: T) -> T:
        """This rank's chunk of ``full`` (a tensor of :attr:`shape`): a view when it is one box
        (``S``, ``RS``), else a new tensor with each box copied in (``SS``)."""
        parts = self.boxes()
        if len(parts) == 1:
            return parts[0].full_view(full)
        local = full.new_empty(self.local_shape)  # type: ignore[attr-defined]
        for box in parts:
            box.local_view(local).copy_(box.full_view(full))
        return local

    def pieces(self, axis: int) -> list[list[Run]]:
        """Per rank of axis number ``axis``, the ranges of its :meth:`split_dim` it keeps, in the
        coordinates of the shard the axes before it leave (the other coordinates this rank's).

        Their lengths are the pieces a gather over the axis collects; their ranges where each
        piece goes back.
        """
        dim = self.split_dim(axis)
        if dim is None:
            raise ValueError(f"axis {axis} of {self} splits no dim")
        n = self.prefix(axis).local_shape[dim]
        placement, _, size = self.shares[axis]
        steps = (_axis_step([(0, n)], placement, rank, size, False) for rank in range(size))
        return [[(a, b) for a, b in runs if a < b] for runs in steps]

    def __str__(self) -> str:
        axes = ", ".join(f"{p} at {rank} of {size}" for p, rank, size in self.shares)
        return f"{self.shape} as {axes or 'a whole'}"


def blocks_problem(ndim: int, placements: Sequence[Placement]) -> str | None:
    """Why a layout (one placement per mesh axis) of a tensor of ``ndim`` dims cannot hold its ``B``
    placements: a dim that ``B`` cuts into blocks must be cut by no other axis (its blocks are
    positions of the whole dim)."""
    for index, placement in enumerate(placements):
        if placement.kind != "B":
            continue
        dim = normalize_dim(placement.dim, ndim)
        for other_index, other in enumerate(placements):
            if other_index == index or other.is_replicate or other.dim is None or other.is_partial:
                continue
            if normalize_dim(other.dim, ndim) == dim:
                return f"{placement} cuts dim {dim} into blocks, and {other} on another axis cuts it too: B must be the only axis sharding its dim"
    return None


def row_heads(block: Any, linear_path: str, rows: int, head_dim: int) -> int:
    """How many heads the ``rows`` output features of the ``nn.Linear`` at ``linear_path`` in ``block`` hold.

    ``rows / head_dim``, unless a module inside the block holds the linear and declares its own
    ``num_heads`` that cuts the rows into heads of another size (a relative-position projection
    of ``num_heads * d_rel`` features): then that many. The block's own ``num_heads`` says
    nothing of this linear (a key projection's rows are its key/value heads).
    """
    parent_path = linear_path.rpartition(".")[0]
    if parent_path:
        heads = getattr(block.get_submodule(parent_path), "num_heads", None)
        if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 and rows % heads == 0:
            if rows // heads != head_dim:
                return heads
    return rows // head_dim
