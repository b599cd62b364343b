"""The boxes a rank's shard is made of (:class:`hpgen.core.shards.ShardLayout`), and when DTensor's placements
describe it exactly.

DTensor's semantics are taken from DTensor itself (``Shard._split_tensor`` and
``_StridedShard._split_tensor`` on an index tensor), not restated, so a torch that
changes them fails here rather than in a checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hpgen.core.placement import Placement
from hpgen.runtime.shard_layout import dtensor_form, dtensor_placement, hpgen_placement
from hpgen.core.shards import ShardLayout

S0, SS02, SS03, R = (Placement.parse(t) for t in ("S(0)", "SS(0,2)", "SS(0,3)", "R"))


def _dtensor_split(n: int, placement, m: int) -> list[list[int]]:
    pieces, _ = placement._split_tensor(torch.arange(n), m, with_padding=False)
    return [piece.tolist() for piece in pieces] + [[]] * (m - len(pieces))


def _dtensor_indices(n: int, placement: Placement, m: int, r: int) -> list[int]:
    """What DTensor gives rank ``r`` of ``m``, read by the core (``torch.chunk`` pieces)."""
    return ShardLayout((n,), [(placement, r, m)]).indices(0, chunked=True)


@pytest.mark.parametrize("m", [2, 3, 4])
def test_dtensor_semantics_as_dtensor_itself_splits(m: int) -> None:
    for n in range(0, 13):
        assert [_dtensor_indices(n, S0, m, r) for r in range(m)] == _dtensor_split(n, Shard(0), m)
        for k in (2, 3):
            if n % k:
                continue
            strided = _StridedShard(0, split_factor=k)
            ss = Placement("SS", dim=0, blocks=k)
            assert [_dtensor_indices(n, ss, m, r) for r in range(m)] == _dtensor_split(n, strided, m)


def test_strided_shard_is_ss_when_the_blocks_split_alike() -> None:
    # SS(d,k): each rank takes its tensor_split chunk of each of the k packed blocks
    for n, k, m in [(10, 2, 2), (12, 3, 2), (8, 2, 4), (18, 3, 3), (14, 2, 2)]:
        ss = Placement("SS", dim=0, blocks=k)
        for r in range(m):
            layout = ShardLayout((n,), [(ss, r, m)])
            assert layout.indices(0) == layout.local_slice(torch.arange(n)).tolist()
        assert dtensor_form((n, 3), (ss,), (m,)).placements == (_StridedShard(0, split_factor=k),)


def test_agreement_and_refusal() -> None:
    assert dtensor_form((5, 3), (S0,), (2,)).placements == (Shard(0),)  # 3,2 both ways
    assert dtensor_form((8, 3), (S0,), (4,)).placements == (Shard(0),)
    form = dtensor_form((5, 3), (S0,), (4,))  # tensor_split 2,1,1,1; chunk 2,2,1,0
    assert not form.exact and "torch.tensor_split" in form.problem and "torch.chunk" in form.problem
    assert form.chunked == (Shard(0),)  # the state dict holds a copy laid out this way instead
    packed = dtensor_form((10, 3), (Placement.parse("SS(0,2)"),), (4,))  # blocks of 5 on 4
    assert not packed.exact and packed.chunked == (Shard(0),)
    # two axes on one dim: DTensor's nested chunks, compared on every coordinate
    assert dtensor_form((8, 2), (S0, S0), (2, 2)).placements == (Shard(0), Shard(0))
    assert dtensor_form((7, 2), (S0, S0), (2, 2)).placements == (Shard(0), Shard(0))  # 2 ranks always agree
    assert not dtensor_form((10, 2), (S0, S0), (2, 4)).exact  # then 5 rows on 4 ranks
    # RS(0,2) on 4 ranks: DTensor sees 2 chunks x 2 replicas
    rs = dtensor_form((8, 3), (Placement.parse("RS(0,2)"),), (4,))
    assert rs.exact and rs.placements == (Shard(0), Replicate()) and rs.split == (2,)
    assert dtensor_form((8, 3), (Placement.parse("RS(0,4)"),), (4,)).placements == (Replicate(),)
    # RS(0,1) is S(0): 5 rows on 4 ranks split differently for DTensor there too
    assert dtensor_form((5, 3), (Placement.parse("RS(0,1)"),), (4,)) == form


def test_dtensor_placements_and_back() -> None:
    from torch.distributed.tensor import Partial

    pairs = [
        ("R", Replicate()),
        ("S(1)", Shard(1)),
        ("SS(0,2)", _StridedShard(0, split_factor=2)),
        ("P(sum)", Partial("sum")),
        ("P(max)", Partial("max")),
    ]
    for text, theirs in pairs:
        assert dtensor_placement(Placement.parse(text)) == theirs
        assert hpgen_placement(theirs) == Placement.parse(text)
    assert dtensor_placement(Placement.parse("S(-1)"), 3) == Shard(2)  # counted from the front for 3 dims
    with pytest.raises(ValueError, match="no DTensor placement"):
        dtensor_placement(Placement.parse("RS(0,2)"))  # Shard x Replicate on an unflattened mesh: dtensor_form


def test_boxes_of_a_packed_shard() -> None:
    # gate_up [2I=10, H=3], SS(0,2) on 2 ranks: rank 1 holds rows 3-4 of gate and 8-9 of up
    layout = ShardLayout((10, 3), [(SS02, 1, 2)])
    assert layout.runs() == [[(3, 5), (8, 10)], [(0, 3)]]
    found = layout.boxes()
    assert [(b.offsets, b.sizes, b.local_offsets) for b in found] == [
        ((3, 0), (2, 3), (0, 0)),
        ((8, 0), (2, 3), (2, 0)),
    ]
    # adjacent ranges merge: S(0) then S(0) on a second axis is one box
    assert ShardLayout((8, 2), [(S0, 1, 2), (S0, 0, 2)]).boxes()[0].offsets == (4, 0)
    full = torch.arange(30).view(10, 3)
    local = layout.local_slice(full)
    for box in found:
        assert torch.equal(box.local_view(local), full[box.global_index()])


def test_core_shard_arithmetic_is_torch_s_own():
    """The core's sizes and bounds are ``torch.tensor_split``'s and ``torch.chunk``'s, empty pieces included."""
    from hpgen.core.shards import chunk_bounds, chunk_sizes, split_bounds, split_sizes

    for n in range(0, 23):
        for k in range(1, 9):
            values = torch.arange(n)
            split = [piece.tolist() for piece in torch.tensor_split(values, k)]
            assert list(split_sizes(n, k)) == [len(piece) for piece in split]
            assert [values[slice(*split_bounds(n, k, r))].tolist() for r in range(k)] == split
            chunks = [piece.tolist() for piece in torch.chunk(values, k)] if n else []
            chunks += [[]] * (k - len(chunks))  # torch.chunk returns fewer pieces; FSDP2 pads with empties
            assert [values[slice(*chunk_bounds(n, k, r))].tolist() for r in range(k)] == chunks
            assert list(chunk_sizes(n, k)) == [len(piece) for piece in chunks]


def test_whole_units_and_blocks_take_shard_where_it_holds_the_same_rows() -> None:
    """8 heads of 4 on 2 ranks: ``S(0,4)`` is DTensor's ``Shard(0)`` exactly; 7 heads on 3 ranks are not
    (12, 8, 8 rows against DTensor's 10, 10, 8), nor are blocks with replicated parts."""
    exact = dtensor_form((32, 5), (Placement.parse("S(0,4)"),), (2,))
    assert exact.exact and exact.placements == (Shard(0),)
    uneven = dtensor_form((28, 5), (Placement.parse("S(0,4)"),), (3,))
    assert not uneven.exact and uneven.placements == (Shard(0),) and "S(0,4) has no DTensor placement" in uneven.problem
    seven = dtensor_form((28, 5), (Placement.parse("S(0,4)"),), (2,))  # 16 and 12 rows: torch.chunk's 14, 14
    assert not seven.exact
    blocks = dtensor_form((36, 5), (Placement.parse("B(0,28:S(0,4),4:R,4:R)"),), (2,))
    assert not blocks.exact and blocks.chunked == (Shard(0),)


def test_replicated_blocks_are_summed_over_their_holders() -> None:
    """The gradient rows of a ``B`` parameter's replicated blocks, in the local shard: adjacent blocks held
    alike merge into one reduction; ``RS`` blocks over their replica sets, ``R`` ones over the axis."""
    from hpgen.runtime.install.hooks import block_regions

    falcon = Placement.parse("B(0,28:S(0,4),4:R,4:R)")
    assert [block_regions(ShardLayout((36, 5), [(falcon, rank, 2)]), ("tp",)) for rank in range(2)] == [
        [(0, 16, 24, "tp", 2)],
        [(0, 12, 20, "tp", 2)],
    ]
    grouped = Placement.parse("B(0,24:S(0,4,2),8:RS(0,2),8:RS(0,2))")  # [6 q | 2 k | 2 v] heads at tp 4
    layout = ShardLayout((40, 5), [(grouped, 3, 4)])
    assert layout.local_shape == (12, 5)  # 1 query head, key head 1, value head 1
    assert block_regions(layout, ("tp",)) == [(0, 4, 12, "tp", 2)]
    assert block_regions(ShardLayout((36, 5), [(falcon, 0, 1)]), ("tp",)) == []  # one rank: nothing to sum
