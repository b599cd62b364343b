"""``hpgen.runtime.trainer.Trainer`` against a stock ``transformers.Trainer`` run of the unsharded model on one process.

Three spawns: the reference (one process), 2 gloo ranks and 4 gloo ranks, each running every
case of its size in turn (``tests.support.trainer_runs``). Each case trains 4 AdamW steps with
clipping active; the test compares each step's logged loss and ``grad_norm`` with the
reference's and the final unsharded weights (AdamW turns float rounding of gradients near zero
into steps of up to ``lr``, hence the looser weight tolerance). What hpgen's Trainer refuses
(another mesh's checkpoint, a run accelerate does not see) stops before a step; the stock loops
are ``test_stock_loops.py``'s.
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
        Run("tp 2", save=True, evaluate=True, **plan(2)),
        Run("tp 2, TrainingArguments(output_dir) as constructed", defaults=True, **plan(2)),
        Run("tp 2, eval_use_gather_object, predictions as lists", gather_object=True, evaluate=True, **plan(2)),
        Run("tp 2, resumed at step 2", resume="tp 2", **plan(2)),
        Run("tp 2 + sp", sp=True, **plan(2, sp=True)),
        Run("tp 2, LoRA after parallelize", lora="after", save=True, **plan(2)),
        Run("tp 2, LoRA after parallelize, resumed", lora="after", resume="tp 2, LoRA after parallelize", **plan(2)),
        Run("tp 2, LoRA before parallelize", lora="before", **plan(2)),
        Run("hpgen Trainer without torchrun's environment", loop="hpgen, no torchrun environment", **plan(2)),
    ]
    four = [
        Run("tp 4 (RS key/value heads)", tp=4, **plan(4)),
        Run("dp 2 x tp 2 (DDP on dp)", dp=2, sp=True, save=True, evaluate=True, **plan(2, sp=True)),
        Run("dp 2 x tp 2 (DDP), resumed", dp=2, sp=True, resume="dp 2 x tp 2 (DDP on dp)", **plan(2, sp=True)),
        Run("dp 2 x tp 2, eval_use_gather_object, predictions as lists", dp=2, sp=True, gather_object=True, evaluate=True,
            **plan(2, sp=True)),
        Run("dp 2 x tp 2 (FSDP2 on dp)", dp=2, sp=True, fsdp=True, save=True, **plan(2, sp=True)),
        Run("dp 2 x tp 2 (FSDP2), resumed", dp=2, sp=True, fsdp=True, resume="dp 2 x tp 2 (FSDP2 on dp)", **plan(2, sp=True)),
    ]
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


def _table(trained: dict[str, Any]) -> list[tuple[str, float, float, float, float, list[int]]]:
    return trainer_runs.parity_table(trained["references"], trained["runs"], trained["cases"])


def test_every_loop_matches_the_one_process_trainer(trained: dict[str, Any]) -> None:
    for name, loss, norm, mean, weights, steps in _table(trained):
        resumed = "resumed" in name
        if "as constructed" in name:  # logged once, at the end: the mean loss of 6 steps (3 epochs of 2)
            assert steps == [], (name, steps)
        else:
            assert steps == (list(range(3, STEPS + 1)) if resumed else list(range(1, STEPS + 1))), (name, steps)
        assert loss < LOSS_TOL and norm < NORM_TOL and mean < LOSS_TOL and weights < WEIGHT_TOL, (name, loss, norm, mean, weights)


def test_the_default_arguments_train(trained: dict[str, Any]) -> None:
    """TrainingArguments as constructed on the CPU: accelerate sees the run (no use_cpu), so the loss is not scaled
    to zero; the weights differ from the one-process run's by far less than they moved."""
    (run,) = [run for run in trained["cases"] if run.defaults]
    reference = trained["references"][trainer_runs.reference_key(run)]
    mine = trained["runs"][run.name]
    initial = trainer_runs.reference_model(run.kv_heads, lora=False).state_dict()
    moved = max((reference["weights"][k] - v).abs().max().item() for k, v in initial.items())
    apart = max((mine["weights"][k] - v).abs().max().item() for k, v in reference["weights"].items())
    print(f"\ndefault arguments: train_loss {mine['training_loss']:.6f} (one process {reference['training_loss']:.6f}); "
          f"weights moved {moved:.1e}, apart from the one-process run's {apart:.1e}")
    assert mine["training_loss"] > 1.0 and apart < moved / 10, (mine["training_loss"], moved, apart)


def test_evaluate_matches_the_one_process_trainer(trained: dict[str, Any]) -> None:
    """evaluate() before and after training and predict()'s gathered logits: one prediction per eval sample (10: the
    last batch a remainder), not one per rank of a tensor-parallel group."""
    print("\n| loop | eval_loss before | after | predictions | max logits diff |\n|---|---:|---:|---|---:|")
    checked = 0
    for run in trained["cases"]:
        if not run.evaluate or run.gather_object:
            continue
        before, after, (logits, labels) = trained["runs"][run.name]["evaluated"]
        ref_before, ref_after, (ref_logits, ref_labels) = trained["references"][trainer_runs.reference_key(run)]["evaluated"]
        worst = (logits - ref_logits).abs().max().item() if logits.shape == ref_logits.shape else float("inf")
        print(f"| {run.name} | {abs(before - ref_before):.1e} | {abs(after - ref_after):.1e} | "
              f"{tuple(logits.shape)} vs {tuple(ref_logits.shape)} | {worst:.1e} |")
        assert logits.shape == ref_logits.shape == (trainer_runs.EVAL_SAMPLES, trainer_runs.SEQ, 127), logits.shape
        assert labels.equal(ref_labels)
        assert abs(before - ref_before) < LOSS_TOL and abs(after - ref_after) < LOSS_TOL, (before, ref_before, after, ref_after)
        assert worst < WEIGHT_TOL, worst
        checked += 1
    assert checked == 2


def test_evaluate_gathering_objects_matches_the_one_process_trainer(trained: dict[str, Any]) -> None:
    """eval_use_gather_object with predictions that are not one tensor (a list of each row's tokens, rows of unequal
    lengths, batches kept apart): the same loss, metrics, rows and labels as one process, at tp 2 and dp 2 x tp 2
    (each row once, the last batch's padding dropped)."""
    print("\n| loop | eval_loss before | after | metrics before, after (one process) | rows |\n|---|---:|---:|---|---|")
    checked = 0
    for run in trained["cases"]:
        if not run.gather_object:
            continue
        before, after, (rows, labels), metrics = trained["runs"][run.name]["evaluated"]
        ref_before, ref_after, (ref_rows, ref_labels), ref_metrics = trained["references"][
            trainer_runs.reference_key(run)]["evaluated"]
        print(f"| {run.name} | {abs(before - ref_before):.1e} | {abs(after - ref_after):.1e} | {metrics} "
              f"({ref_metrics}) | {len(rows)} ({len(ref_rows)}) |")
        assert len(rows) == len(ref_rows) == trainer_runs.EVAL_SAMPLES and rows == ref_rows, (len(rows), len(ref_rows))
        assert labels.equal(ref_labels), (labels.shape, ref_labels.shape)
        assert metrics == ref_metrics and metrics[0]["eval_tokens"] > trainer_runs.EVAL_SAMPLES, (metrics, ref_metrics)
        assert abs(before - ref_before) < LOSS_TOL and abs(after - ref_after) < LOSS_TOL, (before, ref_before, after, ref_after)
        checked += 1
    assert checked == 2


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


def test_what_hpgen_trainer_refuses_stops_before_a_step_with_the_shards_unchanged(trained: dict[str, Any]) -> None:
    """Resuming on another mesh, and a run accelerate does not see as distributed: the same error on every rank, no
    weight changed. (Stock loops on a parallelized model: test_stock_loops.py.)"""
    print("\n| run | stopped | weights moved |\n|---|---|---:|")
    for run in trained["refused"]:
        result = trained["runs"][run.name]
        error = result["errors"][0] or ""
        print(f"| {run.name} | {error.split(':')[0] or 'no'} | {result['drift']:.1e} |")
        assert len(set(result["errors"])) == 1, result["errors"]  # the same error on every rank
        assert result["drift"] == 0.0, (run.name, result["drift"])
        if run.loop == "hpgen, another mesh":  # refused before any weight changes, naming both meshes
            assert "ValueError" in error and "{'tp': 2}" in error and "{'tp': 4}" in error, (run.name, error)
        else:  # accelerate counts 1 process of 2: stopped before training
            assert "hpgen.runtime.trainer.Trainer" in error, (run.name, error)
            assert "accelerate sees 1 process(es)" in error and "torchrun" in error, (run.name, error)
