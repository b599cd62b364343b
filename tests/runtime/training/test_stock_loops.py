"""A stock ``transformers.Trainer`` or accelerate loop on a parallelized model stops before its first optimizer step.

Every configuration (tp 2 on 2 gloo ranks, and dp 2 x tp 2 on 4): transformers' Trainer on its
defaults, with ``use_cpu``, with accelerate's ``ParallelismConfig``, with ``fsdp=``, on a model
presenting transformers' tensor-parallel attributes or load-time sharding, resuming a checkpoint,
on a peft model; ``Accelerator().prepare`` on its defaults, with ``cpu=True``, with an FSDP2 plugin,
and its tensor-parallel, FSDP and FSDP2 preparations (their state set on the CPU as on GPUs);
``prepare_model`` called directly. Each stops on every rank with the same message naming
``hpgen.runtime.trainer.Trainer``, the weights exactly as loaded (a resume would have loaded other
ones). A DDP whose ignore list was replaced stops at its first forward, saying the shards were
overwritten. hpgen's own Trainer asked for accelerate's sharding (``fsdp=``, ``parallelism_config=``)
stops when it is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import stock_loops
from tests.support.dist import run_distributed
from tests.support.stock_loops import Case
from tests.support.trainer_runs import Run


def _cases(directory: Path) -> tuple[list[Case], list[Case]]:
    from tests.support.models import generated_plan, lower_family

    plans = {}
    for tp, sp in ((2, False), (2, True)):
        document = generated_plan("llama", tp=tp, sp=sp)
        folder = directory / f"tp{tp}{'sp' if sp else ''}"
        folder.mkdir()
        plans[(tp, sp)] = dict(plan=document, generated=str(lower_family("llama", document, folder)))
    tp2 = Run("tp 2", **plans[(2, False)])
    lora = Run("tp 2, LoRA after parallelize", lora="after", **plans[(2, False)])
    unchecked = Run("tp 2, check_inputs=False", check_inputs=False, **plans[(2, False)])
    two = [
        Case("Trainer(TrainingArguments as the run's)", "trainer", run=tp2),
        Case("Trainer, use_cpu=True", "trainer", arguments={"use_cpu": True}, run=tp2),
        Case("Trainer, parallelize(check_inputs=False)", "trainer", run=unchecked),
        Case("Trainer, ParallelismConfig(tp_size=2)", "trainer", arguments={"parallelism_config": True}, run=tp2),
        Case("Trainer, ParallelismConfig(tp_size=2), use_cpu=True", "trainer",
             arguments={"parallelism_config": True, "use_cpu": True}, run=tp2),
        Case("Trainer, fsdp='full_shard' (FSDP2)", "trainer",
             arguments={"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}}, run=tp2),
        Case("Trainer, fsdp='full_shard' (FSDP2), use_cpu=True", "trainer",
             arguments={"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}, "use_cpu": True}, run=tp2),
        Case("Trainer, fsdp='full_shard' (FSDP1), use_cpu=True", "trainer",
             arguments={"fsdp": "full_shard", "use_cpu": True}, run=tp2),
        Case("Trainer, model with tp_size and DistributedConfig", "trainer", variant="tp attributes", run=tp2),
        Case("Trainer(use_cpu=True), model with tp_size and DistributedConfig", "trainer", variant="tp attributes",
             arguments={"use_cpu": True}, run=tp2),
        Case("Trainer, model flagged as sharded at load", "trainer", variant="loaded sharded", run=tp2),
        Case("Trainer.train(resume_from_checkpoint=...)", "trainer", variant="resume", run=tp2),
        Case("Trainer, peft model (LoRA after parallelize)", "trainer", run=lora),
        Case("Accelerator().prepare", "accelerate", run=tp2),
        Case("Accelerator(cpu=True).prepare", "accelerate", variant="cpu=True", run=tp2),
        Case("Accelerator(cpu=True, fsdp_plugin=FSDP2).prepare", "accelerate", variant="FSDP2 plugin", run=tp2),
        Case("Accelerator().prepare, ParallelismConfig(tp_size=2) state", "accelerate",
             variant="ParallelismConfig state", run=tp2),
        Case("Accelerator().prepare, FSDP state", "accelerate", variant="FSDP state", run=tp2),
        Case("Accelerator().prepare, FSDP2 state", "accelerate", variant="FSDP2 state", run=tp2),
        Case("Accelerator().prepare_model", "accelerate", variant="prepare_model", run=tp2),
        Case("Accelerator().prepare, peft model", "accelerate", run=lora),
        Case("DistributedDataParallel(model), ignore list replaced", "ddp, ignore list replaced", run=tp2),
        Case("hpgen Trainer, fsdp='full_shard' (FSDP2)", "hpgen trainer",
             arguments={"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}}, run=tp2),
        Case("hpgen Trainer, ParallelismConfig(tp_size=2)", "hpgen trainer", arguments={"parallelism_config": True},
             run=tp2),
    ]
    dp2tp2 = Run("dp 2 x tp 2", dp=2, sp=True, **plans[(2, True)])
    four = [
        Case("Trainer, dp 2 x tp 2", "trainer", run=dp2tp2),
        Case("Accelerator().prepare, dp 2 x tp 2, FSDP2 state", "accelerate", variant="FSDP2 state", run=dp2tp2),
    ]
    return two, four


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("stock")
    two, four = _cases(directory)
    stock_loops.checkpoint(directory / "stock-checkpoint")
    results = run_distributed(stock_loops.stopped, two, str(directory), world_size=2, timeout=600)[0]
    results.update(run_distributed(stock_loops.stopped, four, str(directory), world_size=4, timeout=600)[0])
    print("\n| loop | stopped with | weights moved |\n|---|---|---:|")
    for name, result in results.items():
        error = result["errors"][0] or ""
        print(f"| {name} | {error.split('. ')[0][:110] or 'nothing'} | {result['drift']:.1e} |")
    return results


def test_every_stock_loop_stops_on_every_rank_with_the_weights_as_loaded(stopped: dict[str, Any]) -> None:
    for name, result in stopped.items():
        if name.startswith(("DistributedDataParallel", "hpgen Trainer")):
            continue
        errors = result["errors"]
        assert errors[0] is not None and len(set(errors)) == 1, (name, errors)  # the same error on every rank
        assert "hpgen.runtime.trainer.Trainer" in errors[0] and "hpgen.runtime.clip_grad_norm_" in errors[0], (name, errors[0])
        assert "no optimizer step was taken" in errors[0], (name, errors[0])
        assert result["drift"] == 0.0, (name, result["drift"])


def test_a_stock_trainer_stops_in_its_constructor(stopped: dict[str, Any]) -> None:
    """Before accelerate's own checks (ParallelismConfig, FSDP on the CPU) and before a resume loads a weight."""
    for name, result in stopped.items():
        if name.startswith("Trainer"):
            assert "a stock transformers.Trainer (stopped in its constructor)" in result["errors"][0], (name, result)


def test_accelerate_stops_before_it_prepares_anything(stopped: dict[str, Any]) -> None:
    """Before its DDP, tensor-parallel, FSDP or FSDP2 preparation; prepare_model called directly at its first test."""
    for name, result in stopped.items():
        if name.startswith("Accelerator"):
            where = "Accelerator.prepare_model" if name.endswith("prepare_model") else "Accelerator.prepare ("
            assert where in result["errors"][0], (name, result["errors"][0])


def test_a_ddp_whose_ignore_list_was_replaced_says_the_shards_were_overwritten(stopped: dict[str, Any]) -> None:
    result = stopped["DistributedDataParallel(model), ignore list replaced"]
    error = result["errors"][0]
    assert len(set(result["errors"])) == 1 and "OVERWRITTEN" in error and "hpgen.runtime.trainer.Trainer" in error, error
    assert result["drift"] > 0, result["drift"]


def test_hpgen_trainer_refuses_accelerate_sharding_the_model(stopped: dict[str, Any]) -> None:
    """fsdp= or parallelism_config= would have accelerate shard the model over every rank (on the CPU it ignores FSDP
    silently): stopped when the Trainer is made, naming the option and the fix."""
    for name, option in (("hpgen Trainer, fsdp='full_shard' (FSDP2)", "fsdp="),
                         ("hpgen Trainer, ParallelismConfig(tp_size=2)", "parallelism_config=")):
        result = stopped[name]
        error = result["errors"][0]
        assert len(set(result["errors"])) == 1 and error.startswith("ValueError: hpgen.runtime.trainer.Trainer"), error
        assert f"TrainingArguments({option}" in error and "fully_shard" in error, error
        assert result["drift"] == 0.0, result["drift"]
