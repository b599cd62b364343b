"""Which values of one boundary share one size lookup (hpgen.core.shared_sizes)."""

from __future__ import annotations

from hpgen.core.transitions import ValueOps, transition
from hpgen.core.placement import Placement
from hpgen.core.shared_sizes import SharedSizes, shared_sizes


def _value(name: str, *moves: tuple[str, str, str], side: str = "in", sharded: bool = True) -> ValueOps:
    """A declared value whose ops are ``(axis, src, dst)`` transitions, in order."""
    ops = tuple(
        transition(axis, name, Placement.parse(src), Placement.parse(dst), side=side, sharded_body=sharded)
        for axis, src, dst in moves
    )
    return ValueOps(name, ops)


def test_inputs_gathered_alike_share_the_first_ones_lookup() -> None:
    experts = [_value(name, ("ep", "S(0)", "R")) for name in ("hidden_states", "top_k_index", "top_k_weights")]
    output = _value("output", ("ep", "P(sum)", "S(0)"), side="out")
    (group,) = shared_sizes(experts, [output])
    assert group == SharedSizes("ep", 0, "all_gather", 0, ("hidden_states", "top_k_index", "top_k_weights"))
    assert group.leader == "hidden_states"


def test_a_lone_gather_shares_nothing() -> None:
    assert shared_sizes([_value("x", ("tp", "S(1)", "R")), _value("mask", ("tp", "R", "R"))]) == ()


def test_values_cut_another_way_form_groups_of_their_own() -> None:
    values = [
        _value("a", ("ep", "S(0)", "R")),
        _value("b", ("ep", "S(1)", "R")),
        _value("c", ("ep", "S(0)", "R")),
        _value("d", ("ep", "S(1)", "R")),
    ]
    assert [(g.dim, g.members) for g in shared_sizes(values)] == [(0, ("a", "c")), (1, ("b", "d"))]


def test_an_output_gathered_from_the_dim_its_inputs_were_split_on_takes_the_splits_sizes() -> None:
    inputs = [_value("input_ids", ("ep", "R", "S(0)")), _value("position_ids", ("ep", "R", "S(0)"))]
    outputs = [
        _value("last_hidden_state", ("ep", "S(0)", "R"), side="out"),
        _value("other", ("ep", "S(1)", "R"), side="out"),
    ]
    (group,) = shared_sizes(inputs, outputs)
    assert (group.kind, group.members, group.outputs) == ("split", ("input_ids", "position_ids"), (("last_hidden_state", 0),))
    # one split input is a group too when an output follows it
    (alone,) = shared_sizes(inputs[:1], outputs)
    assert alone.members == ("input_ids",) and alone.outputs == (("last_hidden_state", 0),)
    # splits that no output gathers back share nothing: each records its cut for the boundaries after it
    assert shared_sizes(inputs, outputs[1:]) == ()


def test_an_output_after_two_different_splits_of_its_dim_follows_neither() -> None:
    inputs = [_value("a", ("ep", "R", "S(0)")), _value("b", ("ep", "R", "S(0)"), ("tp", "R", "S(0)"))]
    outputs = [_value("out", ("ep", "S(0)", "R"), side="out")]
    assert shared_sizes(inputs, outputs) == ()


def test_no_lookup_after_a_member_has_moved_on_another_axis() -> None:
    # the ep gather comes after a tp gather of the same values: their dim 0 may have changed by then
    values = [_value(name, ("tp", "S(0)", "R"), ("ep", "S(0)", "R")) for name in ("x", "y")]
    (group,) = shared_sizes(values)
    assert (group.axis, group.position) == ("tp", 0)
