"""The placement grammar of docs/plan-format.md."""

import pytest

from hpgen.placement import REPLICATE, Placement


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("R", REPLICATE),
        ("S(0)", Placement("S", dim=0)),
        ("S(-1)", Placement("S", dim=-1)),
        (" S( 2 ) ", Placement("S", dim=2)),
        ("P(sum)", Placement("P", op="sum")),
        ("P(avg)", Placement("P", op="avg")),
        ("P(max)", Placement("P", op="max")),
        ("P(min)", Placement("P", op="min")),
        ("SS(0,2)", Placement("SS", dim=0, blocks=2)),
        ("SS(-1, 3)", Placement("SS", dim=-1, blocks=3)),
        ("RS(0,2)", Placement("RS", dim=0, replicas=2)),
        ("RS( -1 , 4 )", Placement("RS", dim=-1, replicas=4)),
    ],
)
def test_parses(text, expected):
    assert Placement.parse(text) == expected


@pytest.mark.parametrize("text", ["R", "S(0)", "S(-1)", "P(sum)", "P(max)", "SS(0,2)", "RS(0,2)"])
def test_canonical_spelling_round_trips(text):
    assert str(Placement.parse(text)) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("S(x)", "is not a placement"),
        ("S()", "is not a placement"),
        ("r", "is not a placement"),
        ("P(prod)", "partial op must be one of sum, avg, max, min"),
        ("SS(0,0)", "block count must be at least 1"),
        ("RS(0,0)", "replica count must be at least 1"),
        ("RS(0)", "is not a placement"),
        ("S(0", "is not a placement"),
        ("S(\u0663)", "is not a placement"),  # an Arabic-Indic digit is not a dim
        ("", "is not a placement"),
        (3, "expected a string"),
        (None, "expected a string"),
    ],
)
def test_rejects(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Placement.parse(text)


def test_a_layout_writes_the_axes_it_names_and_replaces_one_in_place():
    """What the planner builds its entries from: a Layout written as text once, axes it omits are R."""
    from hpgen.placement import PARTIAL_SUM, shard
    from hpgen.plan_entries import Layout

    layout = Layout.same(("tp",), REPLICATE).with_axis("ep", shard(0))
    assert layout.document() == {"tp": "R", "ep": "S(0)"}
    assert layout.with_axis("tp", PARTIAL_SUM).placements == (("tp", PARTIAL_SUM), ("ep", shard(0)))
    assert layout.on("dp") == REPLICATE
    assert Placement.parse(str(PARTIAL_SUM)) == PARTIAL_SUM
