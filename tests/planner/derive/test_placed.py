"""The kinds of a derived entry (:class:`hpgen.planner.derive.placed.Kind`): the boundary each becomes, a leaf's transitions."""

from __future__ import annotations

import pytest


def _text(transition) -> tuple[str, str]:
    return tuple(str(layout.on("tp")) for layout in transition)


def test_each_kind_says_what_it_becomes_and_only_wrapped_leaves_carry_their_transitions() -> None:
    from hpgen.planner.derive.placed import Kind

    assert len(Kind) == 14 and f"{Kind.COL_LEAF}" == "col_leaf" and Kind("split_row") is Kind.SPLIT_ROW
    for kind in Kind:
        wrapped = kind.boundary in ("linear", "embedding")
        assert (kind.leaf_transitions is not None) == wrapped, kind
        assert not (kind.holds_group and not kind.shards_layers), kind
    assert _text(Kind.COL_LEAF.leaf_transitions[0]) == ("R", "R")
    assert _text(Kind.COL_LEAF.leaf_transitions[1]) == ("S(-1)", "S(-1)")  # the output stays sharded
    assert _text(Kind.ROW_LEAF.leaf_transitions[0]) == ("S(-1)", "S(-1)")
    assert _text(Kind.ROW_LEAF.leaf_transitions[1]) == ("P(sum)", "R")
    assert _text(Kind.GATHER_LEAF.leaf_transitions[0]) == ("S(-1)", "R")  # its input gathered whole on entry
    assert Kind.EMBEDDING.leaf_transitions[0] is None
    assert [k for k in Kind if k.self_contained] == [Kind.BLOCK, Kind.COL_GATHER, Kind.SPLIT_ROW, Kind.SPLIT_ROW_LEAF]


def test_an_entry_kind_is_read_from_its_text_and_anything_else_is_refused() -> None:
    from hpgen.planner.derive.placed import Kind, Placed

    assert Placed("model.layers.0.mlp", "block").kind is Kind.BLOCK
    with pytest.raises(ValueError, match="not a valid Kind"):
        Placed("model.layers.0.mlp", "blocks")
