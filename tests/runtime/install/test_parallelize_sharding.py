"""The shard arithmetic behind ``parallelize``: which chunk of a parameter a rank keeps."""

from __future__ import annotations

import pytest
import torch

from hpgen.core.placement import Placement
from hpgen.runtime.install.groups import replica_rank_lists
from hpgen.core.shards import ShardLayout, placement_problem, split_sizes

S0, S1, R = Placement.parse("S(0)"), Placement.parse("S(-1)"), Placement.parse("R")



def test_split_sizes_follow_tensor_split() -> None:
    for n in range(0, 12):
        for k in range(1, 5):
            assert split_sizes(n, k) == tuple(len(c) for c in torch.arange(n).tensor_split(k))


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_uneven_shard_and_negative_dim(rank: int) -> None:
    full = torch.arange(7 * 5).view(7, 5)
    assert torch.equal(ShardLayout((7, 5), [(S0, rank, 3)]).local_slice(full), full.tensor_split(3, 0)[rank])
    on_last = ShardLayout((7, 5), [(S1, rank, 3)])
    assert torch.equal(on_last.local_slice(full), full.tensor_split(3, 1)[rank])
    assert on_last.local_shape == tuple(full.tensor_split(3, 1)[rank].shape)


@pytest.mark.parametrize("rank", [0, 1])
def test_strided_shard_takes_a_chunk_of_every_block(rank: int) -> None:
    gate, up = torch.randn(5, 3), torch.randn(5, 3)  # a fused gate_up_proj: [gate; up]
    layout = ShardLayout((10, 3), [(Placement.parse("SS(0,2)"), rank, 2)])
    chunk = layout.local_slice(torch.cat([gate, up]))
    assert torch.equal(chunk, torch.cat([gate.tensor_split(2)[rank], up.tensor_split(2)[rank]]))
    assert layout.local_shape == tuple(chunk.shape)


def test_two_axes_split_in_mesh_order() -> None:
    full = torch.arange(10)
    # rank 1 of 2 on the first axis holds [5, 10); rank 0 of 2 on the second holds its first 3
    layout = ShardLayout((10,), [(S0, 1, 2), (S0, 0, 2)])
    assert torch.equal(layout.local_slice(full), torch.tensor([5, 6, 7]))
    assert layout.range(0) == (5, 8)
    assert ShardLayout((10,), [(R, 0, 2)]).range(0) == (0, 10)


def test_a_rank_holding_nothing_keeps_its_place_and_several_ranges_are_refused() -> None:
    # 2 rows on 4 ranks: ranks 2 and 3 hold none, an empty range after the rows held
    assert [ShardLayout((2, 3), [(S0, r, 4)]).range(0) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError, match="2 ranges"):
        ShardLayout((10, 3), [(Placement.parse("SS(0,2)"), 1, 2)]).range(0)


def test_placements_a_parameter_cannot_take() -> None:
    assert "partial" in placement_problem((4, 4), Placement.parse("P(sum)"), 2)
    assert "dim 2" in placement_problem((4, 4), Placement.parse("S(2)"), 2)
    assert "3 packed blocks" in placement_problem((4, 4), Placement.parse("SS(0,3)"), 2)
    assert placement_problem((4, 4), Placement.parse("S(-2)"), 2) is None


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_replicated_shard_puts_each_chunk_on_consecutive_ranks(rank: int) -> None:
    full = torch.arange(2 * 3 * 5).view(6, 5)  # 2 heads of 3 rows, 4 ranks: each head on 2 of them
    rs = Placement.parse("RS(0,2)")
    layout = ShardLayout((6, 5), [(rs, rank, 4)])
    chunk = layout.local_slice(full)
    assert torch.equal(chunk, full[3 * (rank // 2) : 3 * (rank // 2) + 3])
    assert layout.local_shape == (3, 5)
    assert layout.range(0) == (3 * (rank // 2), 3 * (rank // 2) + 3)
    # after a first axis of 2 (rows [0, 3) or [3, 6)), RS(0,2) on a second axis of 2 keeps them whole
    assert torch.equal(ShardLayout((6, 5), [(S0, rank // 2, 2), (rs, rank % 2, 2)]).local_slice(full), chunk)


def test_pieces_say_what_each_rank_of_an_axis_holds_for_a_gather() -> None:
    # 7 rows over two axes of 2: the first leaves this rank (1 of 2) rows [4, 7), which the second splits
    layout = ShardLayout((7, 2), [(S0, 1, 2), (S0, 0, 2)])
    assert layout.pieces(0) == [[(0, 4)], [(4, 7)]]  # of the full 7 rows
    assert layout.pieces(1) == [[(0, 2)], [(2, 3)]]  # of the 3 rows the first axis left this rank
    packed = ShardLayout((10, 3), [(Placement.parse("SS(0,2)"), 0, 2)])
    assert packed.pieces(0) == [[(0, 3), (5, 8)], [(3, 5), (8, 10)]]
    replicated = ShardLayout((6, 3), [(Placement.parse("RS(0,2)"), 0, 4)])
    assert replicated.pieces(0) == [[(0, 3)], [(0, 3)], [(3, 6)], [(3, 6)]]


def test_replicated_shard_needs_replicas_that_divide_the_axis() -> None:
    assert "3 ranks, which does not divide the axis size 4" in placement_problem((6, 5), Placement.parse("RS(0,3)"), 4)
    assert placement_problem((6, 5), Placement.parse("RS(-2,4)"), 4) is None


def test_replica_groups_are_runs_of_consecutive_ranks_of_each_copy_of_the_axis() -> None:
    mesh = [[0, 1, 2, 3], [4, 5, 6, 7]]  # dp x tp = 2 x 4
    assert replica_rank_lists(mesh, 1, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # the axis need not be the last: on dp, each column is a copy of it
    assert replica_rank_lists(mesh, 0, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert replica_rank_lists([[0, 1, 2, 3]], 1, 4) == [[0, 1, 2, 3]]


def test_the_heads_a_linears_rows_hold_follow_the_module_that_holds_it() -> None:
    """A relative-position projection of ``num_heads * d_rel`` rows inside its own module holds that module's
    heads; a key projection directly in the attention holds rows / head_dim heads, whatever the attention's
    ``num_heads``."""
    from torch import nn

    from hpgen.core.shards import row_heads

    attention = nn.Module()
    attention.num_heads, attention.head_dim = 4, 16
    attention.k_proj = nn.Linear(64, 32, device="meta")  # 2 key/value heads of 16
    attention.relative = nn.Module()
    attention.relative.num_heads = 4
    attention.relative.linear = nn.Linear(64, 16, device="meta")  # 4 heads of d_rel 4
    assert row_heads(attention, "k_proj", 32, 16) == 2
    assert row_heads(attention, "relative.linear", 16, 16) == 4
    attention.relative.num_heads = 1  # one head of 16: the plain count
    assert row_heads(attention, "relative.linear", 16, 16) == 1
