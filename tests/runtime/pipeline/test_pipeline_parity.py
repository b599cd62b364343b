"""Pipeline stages on gloo against one process: the batch's loss, every gradient, logits and greedy tokens.

Each case cuts a tiny model into stages with ``hpgen plan --pp``'s planner, parallelizes it
on real ranks and runs ``pipeline_step`` on a batch whose labels have -100 spread unequally
over the microbatches (a row all ignored, rows ignored in part), so a loss averaged per
microbatch would differ from the batch's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpgen.planner.model.load import meta_model
from hpgen.planner.passes.pipeline_stages import add_pipeline, stage_cut
from tests.support.dist import run_distributed
from tests.support.models import generated_plan, make_config
from tests.support.pipeline_runs import lowered, run_stages


def _staged_plan(family: str, config: dict, pp: int, *, tp: int | None = None, layers=None) -> dict:
    cut = stage_cut(meta_model(make_config(family, **config)), pp, layers=layers)
    return add_pipeline(generated_plan(family, config, tp=tp) if tp else None, cut)


def _check(runs, *, infer: bool) -> None:
    if infer:  # generate draws from the first rank's random state on every rank
        assert all(run.sampled == runs[0].sampled for run in runs), [run.sampled for run in runs]
    for rank, run in enumerate(runs):
        assert abs(run.loss - run.reference_loss) <= 1e-5 * max(1.0, abs(run.reference_loss)), (rank, run.loss, run.reference_loss)
        wrong = {name: error for name, error in run.grad_errors.items() if not error[0] <= error[1]}
        assert run.grad_errors and not wrong, f"rank {rank}: {wrong}"
        # clip_grad_norm_ counts every stage once (a tied table once, though two stages hold it)
        assert abs(run.norm - run.reference_norm) <= 1e-5 * run.reference_norm, (rank, run.norm, run.reference_norm)
        if infer:
            assert (run.logits - run.reference_logits).abs().max().item() <= 1e-4
            assert run.tokens == run.reference_tokens


# (family, config, pp, microbatches, schedule, infer); pp ranks, one stage each unless the plan has more stages
CASES = {
    "gpipe_4mb": ("llama", dict(num_hidden_layers=4), 2, 4, "GPipe", True),
    "1f1b_2mb": ("llama", dict(num_hidden_layers=4), 2, 2, "1F1B", False),
    "qwen3_tied": ("qwen3", dict(num_hidden_layers=4, tie_word_embeddings=True), 2, 2, "1F1B", True),
    # experts whole inside each stage (experts sharded by expert across stages, --ep, are refused)
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=4), 2, 2, "1F1B", True),
}


def test_a_padded_batch_matches_one_process():
    config = dict(num_hidden_layers=4)
    plan = _staged_plan("llama", config, 2)
    runs = run_distributed(run_stages, "llama", config, plan, (("pp", 2),), None, 2, "1F1B", False, True, timeout=240)
    _check(runs, infer=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_stages_match_one_process(case):
    family, config, pp, microbatches, schedule, infer = CASES[case]
    plan = _staged_plan(family, config, pp)
    runs = run_distributed(run_stages, family, config, plan, (("pp", pp),), None, microbatches, schedule, infer, timeout=240)
    _check(runs, infer=infer)
    assert set(runs[0].param_names).isdisjoint(n for n in runs[1].param_names if "embed" not in n and "lm_head" not in n)
    if config.get("tie_word_embeddings"):  # the table on both ends, under each end's name
        assert "model.embed_tokens.weight" in runs[0].param_names and "lm_head.weight" in runs[1].param_names


def test_interleaved_1f1b_runs_two_stages_a_rank():
    config = dict(num_hidden_layers=4)
    plan = _staged_plan("llama", config, 4)  # 4 stages on 2 ranks: rank 0 holds stages 0 and 2
    runs = run_distributed(run_stages, "llama", config, plan, (("pp", 2),), None, 4, "Interleaved1F1B", True, timeout=240)
    _check(runs, infer=True)
    assert "model.layers.2.mlp.up_proj.weight" in runs[0].param_names and "model.norm.weight" in runs[1].param_names


def test_four_stages_match_one_process():
    config = dict(num_hidden_layers=4)
    plan = _staged_plan("llama", config, 4)
    runs = run_distributed(run_stages, "llama", config, plan, (("pp", 4),), None, 4, "1F1B", True, world_size=4, timeout=400)
    _check(runs, infer=True)


def test_two_stages_of_two_tensor_parallel_ranks_match_one_process(tmp_path: Path):
    config = dict(num_hidden_layers=4)
    plan = _staged_plan("llama", config, 2, tp=2)
    generated = lowered("llama", plan, tmp_path)
    dims = (("pp", 2), ("tp", 2))
    runs = run_distributed(run_stages, "llama", config, plan, dims, generated, 2, "1F1B", True, world_size=4, timeout=400)
    _check(runs, infer=True)
    assert runs[0].param_bytes < runs[1].param_bytes * 1.5 and runs[0].param_names != runs[2].param_names
