"""FSDP2 on the data-parallel dim beside pipeline stages: a (dp 2, pp 2) mesh against one process."""

from __future__ import annotations

from tests.runtime.pipeline.test_pipeline_parity import _staged_plan
from tests.support.dist import run_distributed
from tests.support.pipeline_runs import fsdp_stages


def test_fsdp2_on_dp_beside_two_stages_matches_one_process():
    plan = _staged_plan("llama", dict(num_hidden_layers=4), 2)
    runs = run_distributed(fsdp_stages, plan, 2, world_size=4, timeout=400)
    for rank, run in enumerate(runs):
        assert abs(run["loss"] - run["reference_loss"]) <= 1e-5 * abs(run["reference_loss"]), (rank, run["loss"])
        wrong = {name: error for name, error in run["grad_errors"].items() if not error[0] <= error[1]}
        assert run["grad_errors"] and not wrong, f"rank {rank}: {wrong}"
