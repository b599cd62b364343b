"""The placement grammar of docs/plan-format.md."""

import pytest

from hpgen.core.placement import REPLICATE, Placement


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
    from hpgen.core.placement import PARTIAL_SUM, shard
    from hpgen.core.plan_entries import Layout

    layout = Layout.same(("tp",), REPLICATE).with_axis("ep", shard(0))
    assert layout.document() == {"tp": "R", "ep": "S(0)"}
    assert layout.with_axis("tp", PARTIAL_SUM).placements == (("tp", PARTIAL_SUM), ("ep", shard(0)))
    assert layout.on("dp") == REPLICATE
    assert Placement.parse(str(PARTIAL_SUM)) == PARTIAL_SUM


# --------------------------------------------------------------------------- whole units and blocks


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("S(0,64)", Placement("S", dim=0, unit=64)),
        ("S(0,128,4)", Placement("S", dim=0, unit=128, groups=4)),
        ("S( 1 , 64 )", Placement("S", dim=1, unit=64)),
        ("S(0,1)", Placement("S", dim=0)),  # a unit of one element is S(d)
        ("S(0,64,1)", Placement("S", dim=0, unit=64)),
        (
            "B(0, 4544:S(0,64), 64:R, 64:R)",
            Placement("B", dim=0, parts=((4544, Placement("S", dim=0, unit=64)), (64, REPLICATE), (64, REPLICATE))),
        ),
        ("B(0,8:RS(0,2),4:S(0))", Placement("B", dim=0, parts=((8, Placement("RS", dim=0, replicas=2)), (4, Placement("S", dim=0))))),
    ],
)
def test_parses_whole_units_and_blocks(text, expected):
    assert Placement.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("S(0,64)", "S(0,64)"),
        ("S(0,128,4)", "S(0,128,4)"),
        ("S(0,1)", "S(0)"),
        ("S(0,1,2)", "S(0,1,2)"),
        ("B(0, 4544:S(0,64), 64:R, 64:R)", "B(0,4544:S(0,64),64:R,64:R)"),
    ],
)
def test_whole_units_print_canonically(text, canonical):
    assert str(Placement.parse(text)) == canonical
    assert Placement.parse(canonical) == Placement.parse(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("S(0,0)", "the unit size must be at least 1"),
        ("S(0,64,0)", "the group count must be at least 1"),
        ("B(0, 8:SS(0,2))", "a block takes R, S(d), S(d,u), S(d,u,g) or RS(d,r), not SS(0,2)"),
        ("B(0, 8:P(sum))", "a block takes"),
        ("B(0, 8:S(1))", "names dim 1, not the blocks' dim 0"),
        ("B(0, 0:R)", "a block's size must be at least 1"),
        ("B(0, S(0))", "is not a block 'size:placement'"),
        ("B(0, 8:B(0,8:R))", "a block takes"),
        ("S(0,64,4,2)", "is not a placement"),
    ],
)
def test_whole_units_refused(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Placement.parse(text)


def test_whole_units_are_parameter_placements():
    assert Placement.parse("S(0,64)").whole_units and Placement.parse("B(0,8:R)").whole_units
    assert not Placement.parse("S(0)").whole_units and not Placement.parse("S(0,1)").whole_units
    assert not Placement.parse("RS(0,2)").whole_units
