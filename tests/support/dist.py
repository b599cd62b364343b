"""Run a function on several real processes joined in a ``torch.distributed`` group.

    from tests.support.dist import run_distributed

    def _check_sum(rank: int, world_size: int, scale: float) -> float:   # module level
        t = torch.tensor([rank * scale])
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_distributed(_check_sum, 2.0) == [2.0, 2.0]

The spawner is ``hpgen verify``'s own (:mod:`hpgen.verify.spawn`): a file-store rendezvous,
one CPU thread a rank, the first failing rank's traceback re-raised as :class:`RankFailed`
with the others killed, and a timeout on the whole run.
"""

from __future__ import annotations

from hpgen.verify.spawn import RankFailed, run_distributed

__all__ = ["RankFailed", "run_distributed"]
