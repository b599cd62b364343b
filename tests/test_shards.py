"""The core's shard layout against a plain-list reading of the placements (no torch: a fast module).

The reading below restates docs/plan-format.md on Python lists, one axis after another:
``S(d)`` is ``torch.tensor_split``, ``RS(d,r)`` the same over ``size / r`` chunks (rank
``i`` takes chunk ``i // r``), ``SS(d,k)`` each rank's ``tensor_split`` piece of each of
``k`` blocks; DTensor's reading uses ``torch.chunk`` pieces instead. Every layout of one or
two axes over small sizes must agree with it, rank by rank. ``tests/runtime`` checks the
same sizes and slices against torch and DTensor themselves.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from hpgen.placement import Placement
from hpgen.shards import ShardLayout

Split = Callable[[list[int], int], list[list[int]]]


def tensor_split(values: list[int], k: int) -> list[list[int]]:
    q, extra = divmod(len(values), k)
    bounds = [0]
    for i in range(k):
        bounds.append(bounds[-1] + q + (i < extra))
    return [values[a:b] for a, b in itertools.pairwise(bounds)]


def chunk(values: list[int], k: int) -> list[list[int]]:
    step = -(-len(values) // k) if values else 0
    return [values[i * step : (i + 1) * step] for i in range(k)]


def held(values: list[int], placement: Placement, rank: int, size: int, split: Split) -> list[int]:
    """What ``rank`` of ``size`` keeps of ``values`` (one dim) under ``placement``."""
    if placement.kind == "S":
        return split(values, size)[rank]
    if placement.kind == "RS":
        return split(values, size // placement.replicas)[rank // placement.replicas]
    if placement.kind == "SS":
        block = len(values) // placement.blocks
        blocks = [values[j * block : (j + 1) * block] for j in range(placement.blocks)]
        return [i for part in blocks for i in split(part, size)[rank]]
    return values


def placements(n: int, size: int) -> list[Placement]:
    found = [Placement.parse(text) for text in ("R", "S(0)", "S(-1)")]
    found += [Placement("SS", dim=0, blocks=k) for k in (2, 3) if n % k == 0]
    found += [Placement("RS", dim=0, replicas=r) for r in (2, 4) if size % r == 0]
    return found


def layouts():
    """Layouts of a [n, 3] tensor (n even, odd, smaller than the axes, 0) on one axis of 1-4 ranks and a
    second of 1-3, at every coordinate."""
    for n, size, second in itertools.product((0, 1, 2, 3, 5, 6, 7, 12), (1, 2, 3, 4), (1, 2, 3)):
        for first, then in itertools.product(placements(n, size), placements(n, second)):
            for rank, other in itertools.product(range(size), range(second)):
                left = held(list(range(n)), first, rank, size, tensor_split) if first.dim == 0 else list(range(n))
                if then.kind == "SS" and len(left) % then.blocks:
                    continue  # refused by the placement check before any layout is built
                if then.kind == "RS" and second % then.replicas:
                    continue
                yield ShardLayout((n, 3), [(first, rank, size), (then, other, second)])


def expected(layout: ShardLayout, dim: int, split: Split) -> list[int]:
    values = list(range(layout.shape[dim]))
    for axis, (placement, rank, size) in enumerate(layout.shares):
        if layout.split_dim(axis) == dim:
            values = held(values, placement, rank, size, split)
    return values


@pytest.mark.parametrize("split", [tensor_split, chunk], ids=["hpgen", "dtensor"])
def test_every_layout_holds_what_the_placements_say(split: Split) -> None:
    checked = 0
    for layout in layouts():
        for dim in (0, 1):
            want = expected(layout, dim, split)
            assert layout.indices(dim, chunked=split is chunk) == want, (str(layout), dim)
            if split is tensor_split:
                assert layout.local_shape[dim] == len(want), str(layout)
        checked += 1
    assert checked > 2000


def test_boxes_tile_the_local_shard_and_ranges_are_the_contiguous_ones() -> None:
    for layout in layouts():
        rows = expected(layout, 0, tensor_split)
        cells = {}
        for box in layout.boxes():
            for i, j in itertools.product(range(box.sizes[0]), range(box.sizes[1])):
                cells[(box.local_offsets[0] + i, box.local_offsets[1] + j)] = (box.offsets[0] + i, box.offsets[1] + j)
        columns = expected(layout, 1, tensor_split)
        assert cells == {(a, b): (rows[a], columns[b]) for a in range(len(rows)) for b in range(len(columns))}
        if rows and rows == list(range(rows[0], rows[-1] + 1)):
            assert layout.range(0) == (rows[0], rows[-1] + 1), str(layout)
        elif rows:
            with pytest.raises(ValueError, match="ranges"):
                layout.range(0)


def test_pieces_are_every_rank_of_an_axis_in_what_the_axes_before_left() -> None:
    for layout in layouts():
        for axis, (placement, rank, size) in enumerate(layout.shares):
            dim = layout.split_dim(axis)
            if dim is None:
                continue
            before = layout.prefix(axis).local_shape[dim]
            pieces = layout.pieces(axis)
            positions = list(range(before))
            assert [[i for a, b in runs for i in range(a, b)] for runs in pieces] == [
                held(positions, placement, r, size, tensor_split) for r in range(size)
            ], str(layout)
            assert sorted({i for runs in pieces for a, b in runs for i in range(a, b)}) == positions
