"""``hpgen.runtime.trainer.Trainer`` against a stock ``transformers.Trainer`` run of the unsharded model on one process.

Three spawns: the reference (one process), 2 gloo ranks and 4 gloo ranks, each running every
case of its size in turn (``tests.support.trainer_runs``). Each case trains 4 AdamW steps with
clipping active; the test compares each step's logged loss and ``grad_norm`` with the
reference's and the final unsharded weights (AdamW turns float rounding of gradients near zero
into steps of up to ``lr``, hence the looser weight tolerance). The stock loops (transformers'
``Trainer``, ``Accelerator().prepare``) on a parallelized model stop before their first
optimizer step, naming the fix, with the shards unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_distributed
from tests.support import trainer_runs
from tests.support.trainer_runs import MAX_GRAD_NORM, STEPS, Run

LOSS_TOL, NORM_TOL, WEIGHT_TOL = 2e-5, 1e-4, 5e-4


def _runs(directory: Path) -> tuple[list[Run], list[Run]]:
    """The 2-rank runs and the 4-rank runs, with their plans lowered."""
    from tests.support.models import generated_plan, lower_family

    lowered: dict[tuple[int, bool], tuple[dict, str]] = {}

    def plan(tp: int, sp: bool = False) -> dict[str, Any]:
        if (tp, sp) not in lowered:
            document = generated_plan("llama", tp=tp, sp=sp)
            lowered[(tp, sp)] = (document, str(lower_family("llama", document, directory / f"tp{tp}{'sp' if sp else ''}")))
        document, generated = lowered[(tp, sp)]
        return dict(plan=document, generated=generated)

    two = [
        Run("tp 2", save=True, **plan(2)),
        Run("tp 2, resumed at step 2", resume="tp 2", **plan(2)),
        Run("tp 2 + sp", sp=True, **plan(2, sp=True)),
        Run("tp 2, LoRA after parallelize", lora="after", save=True, **plan(2)),
        Run("tp 2, LoRA after parallelize, resumed", lora="after", resume="tp 2, LoRA after parallelize", **plan(2)),
        Run("tp 2, LoRA before parallelize", lora="before", **plan(2)),
        Run("stock transformers.Trainer", loop="stock", **plan(2)),
        Run("stock transformers.Trainer, check_inputs=False", loop="stock", check_inputs=False, **plan(2)),
        Run("Accelerator().prepare(model, optimizer, dataloader)", loop="accelerate", **plan(2)),
        Run("DistributedDataParallel(model), ignore list replaced", loop="ddp, ignore list replaced", **plan(2)),
    ]
    four = [
        Run("tp 4 (RS key/value heads)", tp=4, **plan(4)),
        Run("dp 2 x tp 2 (DDP on dp)", dp=2, sp=True, save=True, **plan(2, sp=True)),
        Run("dp 2 x tp 2 (DDP), resumed", dp=2, sp=True, resume="dp 2 x tp 2 (DDP on dp)", **plan(2, sp=True)),
        Run("dp 2 x tp 2 (FSDP2 on dp)", dp=2, sp=True, fsdp=True, save=True, **plan(2, sp=True)),
        Run("dp 2 x tp 2 (FSDP2), resumed", dp=2, sp=True, fsdp=True, resume="dp 2 x tp 2 (FSDP2 on dp)", **plan(2, sp=True)),
    ]
    four.append(Run("stock transformers.Trainer, dp 2 x tp 2", loop="stock", dp=2, sp=True, **plan(2, sp=True)))
    four.append(Run("tp 4 resuming the tp 2 checkpoint", loop="hpgen, another mesh", tp=4, resume="tp 2", **plan(4)))
    return two, four


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("trainer")
    for sub in ("tp2", "tp2sp", "tp4"):
        (directory / sub).mkdir()
    two, four = _runs(directory)
    work = str(directory)
    references = run_distributed(trainer_runs.reference, two + four, work, world_size=1, timeout=600)[0]
    runs = run_distributed(trainer_runs.parallel, two, work, world_size=2, timeout=600)[0]
    runs.update(run_distributed(trainer_runs.parallel, four, work, world_size=4, timeout=600)[0])
    return dict(references=references, runs=runs, cases=[run for run in two + four if run.loop == "hpgen"],
                refused=[run for run in two + four if run.loop != "hpgen"])


def _table(trained: dict[str, Any]) -> list[tuple[str, float, float, float, list[int]]]:
    rows = []
    for run in trained["cases"]:
        reference = trained["references"][trainer_runs.reference_key(run)]
        mine = trained["runs"][run.name]
        steps = sorted(mine["steps"])
        loss = max(abs(mine["steps"][s][0] - reference["steps"][s][0]) for s in steps)
        norm = max(abs(mine["steps"][s][1] - reference["steps"][s][1]) for s in steps)
        weights = max((mine["weights"][k] - v).abs().max().item() for k, v in reference["weights"].items())
        rows.append((run.name, loss, norm, weights, steps))
    print("\n| loop | max loss diff | max grad_norm diff | final weights max diff |\n|---|---:|---:|---:|")
    for name, loss, norm, weights, _ in rows:
        print(f"| {name} | {loss:.1e} | {norm:.1e} | {weights:.1e} |")
    return rows


def test_every_loop_matches_the_one_process_trainer(trained: dict[str, Any]) -> None:
    for name, loss, norm, weights, steps in _table(trained):
        resumed = "resumed" in name
        assert steps == (list(range(3, STEPS + 1)) if resumed else list(range(1, STEPS + 1))), (name, steps)
        assert loss < LOSS_TOL and norm < NORM_TOL and weights < WEIGHT_TOL, (name, loss, norm, weights)


def test_clipping_was_active(trained: dict[str, Any]) -> None:
    for reference in trained["references"].values():
        assert all(norm > 2 * MAX_GRAD_NORM for _, norm in reference["steps"].values()), reference["steps"]


def test_the_step_2_checkpoint_loads_in_plain_transformers(trained: dict[str, Any]) -> None:
    from transformers import LlamaForCausalLM

    (run,) = [run for run in trained["cases"] if run.name == "tp 2"]
    reference = trained["references"][trainer_runs.reference_key(run)]["checkpoint_2"]
    saved = LlamaForCausalLM.from_pretrained(trained["runs"][run.name]["checkpoint_2"])
    worst = max((saved.state_dict()[name] - value).abs().max().item() for name, value in reference.items())
    assert worst < WEIGHT_TOL, worst


def test_the_stock_loops_stop_before_a_step_with_the_shards_unchanged(trained: dict[str, Any]) -> None:
    print("\n| loop | stopped | shards | weights moved |\n|---|---|---|---:|")
    for run in trained["refused"]:
        result = trained["runs"][run.name]
        error = result["errors"][0] or ""
        print(f"| {run.name} | {error.split(':')[0] or 'no'} | {'unchanged' if 'unchanged' in error or 'ValueError' in error else 'overwritten (said)' if 'OVERWRITTEN' in error else '?'} | "
              f"{result['drift']:.1e} |")
        assert len(set(result["errors"])) == 1, result["errors"]  # the same error on every rank
        if run.loop == "hpgen, another mesh":  # refused before any weight changes, naming both meshes
            assert "ValueError" in error and "{'tp': 2}" in error and "{'tp': 4}" in error, (run.name, error)
            assert result["drift"] == 0.0, (run.name, result["drift"])
            continue
        assert "hpgen.runtime.trainer.Trainer" in error and "hpgen.runtime.clip_grad_norm_" in error, (run.name, error)
        if run.loop == "ddp, ignore list replaced":  # the broadcast ran: the error says so
            assert "OVERWRITTEN" in error and result["drift"] > 0, (run.name, error, result["drift"])
        else:
            assert "The shards are unchanged" in error, (run.name, error)
            assert result["drift"] == 0.0, (run.name, result["drift"])  # no step taken, no shard overwritten
