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

from hpgen.core.placement import REPLICATE, Placement
from hpgen.core.shards import ShardLayout, blocks_problem, placement_problem

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


# --------------------------------------------------------------------------- whole units and blocks


def _units(values: list[int], unit: int, size: int) -> list[list[int]]:
    """``tensor_split`` over whole units of ``unit`` values: the first ranks one more unit."""
    units = [values[i : i + unit] for i in range(0, len(values), unit)]
    return [[v for u in part for v in u] for part in tensor_split(units, size)]


def held_units(values: list[int], placement: Placement, rank: int, size: int) -> list[int]:
    """docs/plan-format.md's reading of ``S(d,u,g)`` and ``B``, on a list (hpgen's, not DTensor's)."""
    if placement.kind == "B":
        found, offset = [], 0
        for block, inner in placement.parts:
            found += held_units(values[offset : offset + block], inner, rank, size)
            offset += block
        return found
    if placement.kind == "S":
        per_set = size // placement.groups
        group = len(values) // placement.groups
        j, index = divmod(rank, per_set)
        return _units(values[j * group : (j + 1) * group], placement.unit, per_set)[index]
    return held(values, placement, rank, size, tensor_split)


@pytest.mark.parametrize(
    ("n", "text", "size"),
    [
        (7 * 4, "S(0,4)", 2),  # 7 heads at tp 2: 4 and 3
        (7 * 4, "S(0,4)", 3),  # 3, 2, 2
        (6 * 4, "S(0,4,2)", 4),  # 6 query heads in 2 groups of 3 at tp 4: 2, 1 | 2, 1
        (14 * 2, "S(0,2,2)", 4),  # 14 / 2 at tp 4: 4, 3 | 4, 3
        (28 * 2, "S(0,2,4)", 8),  # Qwen2.5-7B's 28 / 4 at tp 8 (head_dim 2): 4, 3 per group
        (71 * 2 + 4, "B(0,142:S(0,2),2:R,2:R)", 2),  # multi-query Falcon: 36 and 35 heads, key and value whole
        (12, "B(0,8:S(0,2),4:RS(0,2))", 4),
    ],
)
def test_whole_unit_layouts_hold_what_the_placements_say(n: int, text: str, size: int) -> None:
    placement = Placement.parse(text)
    assert placement_problem((n, 3), placement, size) is None
    seen = []
    for rank in range(size):
        layout = ShardLayout((n, 3), [(placement, rank, size)])
        want = held_units(list(range(n)), placement, rank, size)
        assert layout.indices(0) == want, (text, rank)
        assert layout.local_shape == (len(want), 3)
        seen += want
        rows = [i for box in sorted(layout.boxes(), key=lambda b: b.local_offsets) for i in range(box.offsets[0], box.offsets[0] + box.sizes[0])]
        assert rows == want
    if "R" not in text:
        assert sorted(seen) == list(range(n))  # every row on exactly one rank


def test_whole_heads_per_rank() -> None:
    """Qwen2.5-7B at tp 8: each group's 7 query heads cut 4/3, next to its key/value head."""
    q, k = Placement.parse("S(0,128,4)"), Placement.parse("RS(0,2)")
    heads = [ShardLayout((28 * 128, 8), [(q, rank, 8)]).local_shape[0] // 128 for rank in range(8)]
    assert heads == [4, 3] * 4
    for rank in range(8):
        q_first = ShardLayout((28 * 128, 8), [(q, rank, 8)]).range(0)[0] // 128
        kv = ShardLayout((4 * 128, 8), [(k, rank, 8)]).range(0)[0] // 128
        assert q_first // 7 == kv  # every query head sits with its key/value head


@pytest.mark.parametrize(
    ("shape", "text", "size", "message"),
    [
        ((28, 4), "S(0,8)", 2, "whole units of 8, which do not divide dim 0 of size 28"),
        ((28, 4), "S(0,2,3)", 6, "into 3 groups, which does not divide"),
        ((24, 4), "S(0,2,4)", 6, "cuts the axis of size 6 into 4 sets of ranks"),
        ((7 * 64, 4), "S(0,64)", 8, "holds 7 units of 64, fewer than the 8 ranks, so a rank would hold none (no head): at most 7 ranks"),
        ((6 * 2, 4), "S(0,2,2)", 8, "each of the 2 groups holds 3 units of 2 for its 4 ranks"),
        ((20, 4), "B(0,8:S(0,2),4:R,4:R)", 2, "blocks add up to 16, but dim 0 has size 20"),
        ((16, 4), "B(0,8:S(0,3),8:R)", 2, "block 0 (8:S(0,3)) of B(0,8:S(0,3),8:R): S(0,3) cuts in whole units of 3"),
        ((16, 4), "B(0,8:S(0),8:RS(0,3))", 2, "block 1"),
    ],
)
def test_whole_unit_placement_problems(shape, text, size, message) -> None:
    assert message in (placement_problem(shape, Placement.parse(text), size) or "")


def test_block_pieces_and_held_counts() -> None:
    """Falcon's fused [heads | key | value] at tp 2, rank 1: 35 heads, then the key and value whole."""
    placement = Placement.parse("B(0,142:S(0,2),2:R,2:R)")
    layout = ShardLayout((146, 3), [(placement, 1, 2)])
    assert layout.local_shape == (74, 3)
    assert layout.block_pieces(0) == [
        (Placement.parse("S(0,2)"), (0, 70)),
        (REPLICATE, (70, 72)),
        (REPLICATE, (72, 74)),
    ]
    assert layout.held_count(0, 0, 142) == 70 and layout.held_count(0, 142, 146) == 4
    assert layout.replicated_blocks() == [(0, 0, 70, 74, 2)]  # key and value: one reduction over both ranks
    assert blocks_problem(2, [placement, Placement.parse("S(0)")]) is not None
    assert blocks_problem(2, [placement, Placement.parse("S(1)")]) is None
