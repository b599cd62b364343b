"""``hpgen.runtime.trainer.Trainer`` on a model cut into pipeline stages, against a stock one-process Trainer.

The runs of ``test_trainer.py`` (``tests.support.trainer_runs``: the same tiny Llama, data,
4 AdamW steps with clipping active, a log per step) on a ``pp 2`` mesh (transformers' own
class, one decoder layer a stage), a ``pp 2 x tp 2`` mesh (the lowered model) and a ``dp 2 x pp 2``
mesh with FSDP2 on ``dp`` (and ``dp 2 x pp 2 x tp 2``, 8 ranks): each step's
logged loss and ``grad_norm`` and the final weights must match the unsharded model's; the
``pp 2`` run saves at step 2, where a fresh run resumes and must end on the same weights; one
run accumulates two batches a step (the reference alike); two have labels ignored over unequal
parts of the sequences, so a loss averaged per batch or microbatch would differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpgen.planner.model.load import meta_model
from hpgen.planner.passes.pipeline_stages import add_pipeline, stage_cut
from tests.support import trainer_runs
from tests.support.dist import run_distributed
from tests.support.trainer_runs import STEPS, Run

LOSS_TOL, NORM_TOL, WEIGHT_TOL = 2e-5, 1e-4, 5e-4


def _staged(tp: int, directory: Path) -> dict[str, Any]:
    """The ``--pp 2`` plan (with ``--tp`` when ``tp`` > 1, lowered into ``directory``)."""
    from tests.support.models import generated_plan, lower_family

    cut = stage_cut(meta_model(trainer_runs.config()), 2)
    if tp == 1:
        return dict(plan=add_pipeline(None, cut), generated="")
    document = add_pipeline(generated_plan("llama", tp=tp), cut)
    return dict(plan=document, generated=str(lower_family("llama", document, directory)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("trainer_pp")
    (directory / "pp2tp2").mkdir()
    pp = _staged(1, directory)
    two = [
        Run("pp 2 (1F1B, 2 microbatches: the stage count)", pp=2, tp=1, save=True, **pp),
        Run("pp 2, resumed at step 2", pp=2, tp=1, resume="pp 2 (1F1B, 2 microbatches: the stage count)", **pp),
        Run("pp 2 (GPipe, 4 microbatches)", pp=2, tp=1, microbatches=4, schedule="GPipe", **pp),
        # each optimizer step two batches whose label tokens differ: the loss is over both batches' tokens
        Run("pp 2, gradient_accumulation_steps=2, -100 labels", pp=2, tp=1, accumulate=2, ignored=True, **pp),
    ]
    four = [
        Run("pp 2 x tp 2 (1F1B, 4 microbatches), -100 labels", pp=2, tp=2, microbatches=4, ignored=True,
            **_staged(2, directory / "pp2tp2")),
        Run("dp 2 x pp 2 (FSDP2 on dp), -100 labels", dp=2, pp=2, tp=1, fsdp=True, ignored=True, **pp),
    ]
    eight = [Run("dp 2 x pp 2 x tp 2 (FSDP2 on dp), -100 labels", dp=2, pp=2, tp=2, fsdp=True, ignored=True,
                 **_staged(2, directory / "pp2tp2"))]
    work = str(directory)
    references = run_distributed(trainer_runs.reference, two + four + eight, work, world_size=1, timeout=600)[0]
    runs = run_distributed(trainer_runs.parallel, two, work, world_size=2, timeout=600)[0]
    runs.update(run_distributed(trainer_runs.parallel, four, work, world_size=4, timeout=600)[0])
    runs.update(run_distributed(trainer_runs.parallel, eight, work, world_size=8, timeout=600)[0])
    return dict(references=references, runs=runs, cases=two + four + eight)


def test_the_pipeline_trains_as_one_process(trained: dict[str, Any]) -> None:
    rows = trainer_runs.parity_table(trained["references"], trained["runs"], trained["cases"])
    for name, loss, norm, mean, weights, steps in rows:
        assert steps == (list(range(3, STEPS + 1)) if "resumed" in name else list(range(1, STEPS + 1))), (name, steps)
        assert loss < LOSS_TOL and norm < NORM_TOL and mean < LOSS_TOL and weights < WEIGHT_TOL, (name, loss, norm, mean, weights)


def test_the_pipeline_checkpoint_loads_in_plain_transformers(trained: dict[str, Any]) -> None:
    from transformers import LlamaForCausalLM

    run = trained["cases"][0]
    reference = trained["references"][trainer_runs.reference_key(run)]["checkpoint_2"]
    saved = LlamaForCausalLM.from_pretrained(trained["runs"][run.name]["checkpoint_2"])
    worst = max((saved.state_dict()[name] - value).abs().max().item() for name, value in reference.items())
    assert worst < WEIGHT_TOL, worst
