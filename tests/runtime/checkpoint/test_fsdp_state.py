"""The composed (FSDP2 ``dp``, plan) DTensor placements, checked for every coordinate, or refused.

Pure functions of shapes (no ranks); the 4-rank spawn in ``test_parity_2d.py`` checks the
same placements against ``full_tensor()`` and DCP on real ranks.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hpgen.runtime.checkpoint.fsdp_state import composed_form


def test_fsdp2_over_a_tp_shard_of_its_dim_is_strided() -> None:
    # 89 rows (uneven) on tp 2, then dp 2: as torch's FSDP2 over DTensor TP
    assert composed_form((89, 64), (Shard(0),), (2,), 0, 2, False) == (
        (_StridedShard(0, split_factor=2), Shard(0)),
        None,
    )


def test_fsdp2_over_another_dim_is_a_plain_shard() -> None:
    assert composed_form((64, 89), (Shard(1),), (2,), 0, 2, False) == ((Shard(0), Shard(1)), None)
    # RS on tp 4 (unflattened to 2 chunks x 2 replicas) under dp 2
    assert composed_form((32, 64), (Shard(0), Replicate()), (2, 2), 0, 2, False) == (
        (_StridedShard(0, split_factor=2), Shard(0), Replicate()),
        None,
    )
    # packed (SS) on dim 1, FSDP2 on dim 0: the blocks stay named (PackedShard)
    assert composed_form((8, 12), (_StridedShard(1, split_factor=2),), (2,), 0, 2, True)[0] == (
        Shard(0),
        _StridedShard(1, split_factor=2),
    )


def test_inexpressible_pieces_are_refused() -> None:
    # 7 rows on tp 2 (4, 3), FSDP2 on 3 ranks chunks the 4 as 2, 2, 0; DTensor would read another row
    placements, problem = composed_form((7, 4), (Shard(0),), (2,), 0, 3, False)
    assert placements is None and "dim 0 of size 7: FSDP2 on 3 ranks" in problem
    placements, problem = composed_form((8, 4), (_StridedShard(0, split_factor=2),), (2,), 0, 2, True)
    assert placements is None and "packed (SS) by the plan and sharded by FSDP2" in problem
