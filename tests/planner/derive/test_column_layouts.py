"""A column projection's layout, read from the reshape after it (hpgen.planner.derive.column_layouts), and the placement it gives."""

from __future__ import annotations

import pytest

from hpgen.core.placement import Placement
from hpgen.planner.flow.values import ShapeUse, Val
from hpgen.planner.derive.column_layouts import (
    PLAIN,
    ColumnLayout,
    UnequalBlocks,
    grouped,
    layout_of,
    packed,
    query_blocks,
    replicated,
)


def use(method: str, *sizes: object) -> ShapeUse:
    """A reshape call on a projection's output with constant size arguments (a list is one argument)."""
    values = tuple(
        Val(items=tuple(Val(const=s) for s in size)) if isinstance(size, list) else Val(const=size) for size in sizes
    )
    return ShapeUse("attn", method, frozenset({"attn.qkv"}), (), values, 7)


@pytest.mark.parametrize(
    ("call", "heads", "layout"),
    [
        (use("split", 64), (4, 4, 16), packed(3)),  # Q|K|V by split_size
        (use("split", [64, 64, 64]), (4, 4, 16), packed(3)),
        (use("split", 192), (4, 4, 16), PLAIN),
        (use("chunk", 3), (4, 4, 16), packed(3)),
        (use("view", None, None, 3, 4, 16), (4, 4, 16), packed(3)),  # [3, heads, head_dim]: blocks
        (use("view", None, None, 4, 3, 16), (4, 4, 16), grouped(4)),  # [heads, 3, head_dim]: interleaved per head
        (use("view", None, None, 4, 48), (4, 4, 16), grouped(4)),
        (use("view", None, None, 2, -1), None, packed(2)),  # an MLP's gate and up
        (use("view", None, None, 12, 16), (4, 4, 16), PLAIN),  # one head per row of the view
        (use("view", None, None, 5, -1), (4, 4, 16), None),  # says nothing
    ],
)
def test_the_first_reshape_gives_the_layout(call: ShapeUse, heads: tuple[int, int, int] | None, layout: object) -> None:
    assert layout_of(call, 192, heads) == layout


def test_unequal_blocks_are_refused_with_the_reason() -> None:
    with pytest.raises(UnequalBlocks, match="unequal sizes"):
        layout_of(use("split", [128, 32, 32]), 192, (8, 1, 16))  # multi-query: [queries | key | value]
    with pytest.raises(UnequalBlocks, match="multi-query"):
        layout_of(use("view", None, None, 6, 16), 96, (4, 2, 16))  # heads + 2 rows, but two key/value heads


def test_multi_query_rows_are_blocks_whose_key_and_value_stay_whole() -> None:
    # Falcon-7B's view(..., heads + 2, head_dim) with one key/value head: [queries | key | value]
    layout = layout_of(use("view", None, None, 6, 16), 96, (4, 1, 16))
    assert layout == query_blocks(4, 16)
    assert layout.placement(0) == Placement.parse("B(0, 64:S(0), 16:R, 16:R)")
    # new_decoder_architecture with one key/value group: view(..., -1, heads + 2, head_dim)
    assert layout_of(use("view", None, None, -1, 6, 16), 96, (4, 1, 16)) == query_blocks(4, 16)
    assert query_blocks(7, 16, PLAIN.in_units(16)).placement(0) == Placement.parse("B(0, 112:S(0,16), 16:R, 16:R)")


@pytest.mark.parametrize(
    ("layout", "dim", "text"),
    [(PLAIN, 0, "S(0)"), (grouped(4), 1, "S(1)"), (packed(3), 0, "SS(0,3)"), (replicated(2), 1, "RS(1,2)")],
)
def test_a_layout_becomes_a_placement_on_the_weight_dim(layout: ColumnLayout, dim: int, text: str) -> None:
    assert layout.placement(dim) == Placement.parse(text)


def test_what_a_layout_says_about_its_shares() -> None:
    assert PLAIN.plain and PLAIN.contiguous and not PLAIN.grouped
    assert grouped(4).contiguous and grouped(4).grouped and not grouped(4).plain
    assert grouped(1) == PLAIN  # one group is no grouping
    assert packed(3).block(192) == 64 and PLAIN.block(192) == 192 and grouped(4).block(192) == 192
    assert replicated(2).replicated and not replicated(2).contiguous
