"""The DDP guard on a DDP over some ranks of the world: every rank of that DDP decides from the mesh's groups.

A DDP over global ranks 0, 1 and 2 of a dp 2 x tp 2 mesh holds the whole tp group {0, 1} and one
rank of {2, 3}. A guard deciding from each rank's own tp group would refuse on ranks 0 and 1 (and
gather digests over the DDP's ranks) but let rank 2 through, leaving 0 and 1 in a collective rank
2 never joins. Read from the mesh, all three refuse alike, with the shards unchanged.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.dist import run_distributed
from tests.support import trainer_runs
from tests.support.trainer_runs import Run


def test_a_ddp_over_three_of_four_ranks_is_refused_on_each_of_its_ranks(tmp_path: Path) -> None:
    from tests.support.models import generated_plan, lower_family

    document = generated_plan("llama", tp=2)
    (tmp_path / "tp2").mkdir()
    generated = str(lower_family("llama", document, tmp_path / "tp2"))
    run = Run("dp 2 x tp 2, DDP over ranks 0-2", dp=2, plan=document, generated=generated)
    result = run_distributed(trainer_runs.ddp_over_three_of_four, run, str(tmp_path), world_size=4, timeout=300)[0]
    inside, outside = result["errors"][:3], result["errors"][3]
    assert outside is None
    assert len(set(inside)) == 1 and inside[0] is not None, inside  # the same error on each rank of the DDP
    assert "ranks 0, 1, 2" in inside[0] and "'tp'" in inside[0] and "The shards are unchanged" in inside[0], inside[0]
    assert "hpgen.runtime.trainer.Trainer" in inside[0]
    assert result["drift"] == 0.0
