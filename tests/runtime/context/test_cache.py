"""``SplitLayer``: this rank's positions in a transformers ``DynamicLayer`` that reports the whole sequence's length."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hpgen.runtime.context.cache import SplitLayer
from hpgen.runtime.forward.context_axis import HeadTail


def _filled(rank: int, size: int = 2, n: int = 7) -> SplitLayer:
    layout = HeadTail(n, size, rank, torch.device("cpu"))
    layer = SplitLayer(rank, size)
    owners = torch.empty(n, dtype=layer.owners.dtype)
    owners[layout.gathered] = torch.repeat_interleave(torch.arange(size, dtype=owners.dtype), torch.tensor(layout.sizes))
    keys = layout.local.float().view(1, 1, -1, 1).expand(2, 3, -1, 4)  # each key holds its position
    layer.keep(keys, keys.clone(), layout.local, owners)
    return layer


def test_new_tokens_go_to_the_rank_holding_fewest_and_lengths_are_the_whole_sequence() -> None:
    ranks = [_filled(0), _filled(1)]  # 7 tokens head-tail over 2 (chunks 2, 2, 2, 1): rank 0 holds 3, rank 1 holds 4
    assert ranks[0].positions.tolist() == [0, 1, 6] and ranks[1].positions.tolist() == [2, 3, 4, 5]
    for step in range(3):
        new = torch.full((2, 3, 1, 4), 7.0 + step)
        for layer in ranks:
            layer.add(new, new)
    assert ranks[0].positions.tolist() == [0, 1, 6, 7, 8] and ranks[1].positions.tolist() == [2, 3, 4, 5, 9]  # ties: the lower rank
    for layer in ranks:
        assert layer.get_seq_length() == 10 and layer.get_mask_sizes(1) == (11, 0)
        assert layer.keys[0, 0, :, 0].tolist() == layer.positions.float().tolist()


def test_crop_reorder_and_a_cache_of_split_layers() -> None:
    layer = _filled(0)
    layer.crop(-2)  # drops positions 5 and 6 (rank 0 held 6)
    assert layer.positions.tolist() == [0, 1] and layer.keys.size(-2) == 2 and layer.get_seq_length() == 5
    layer.reorder_cache(torch.tensor([1, 1]))
    assert layer.keys.size(0) == 2
    cache = DynamicCache()
    cache.layers.append(_filled(1))
    assert cache.get_seq_length() == 7 and cache.get_mask_sizes(2, 0) == (9, 0)
    cache.reset()
    assert cache.get_seq_length() == 0 and layer.positions.numel() == 2
