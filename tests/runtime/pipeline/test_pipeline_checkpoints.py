"""Checkpoints of pipeline stages: each stage reads its tensors, and writes the whole model back out."""

from __future__ import annotations

from tests.support.dist import run_distributed
from tests.support.pipeline_runs import checkpoint_round_trip
from tests.runtime.pipeline.test_pipeline_parity import _staged_plan


def test_from_pretrained_reads_the_stage_and_saves_the_whole_model(tmp_path):
    config = dict(num_hidden_layers=4, tie_word_embeddings=True)
    plan = _staged_plan("qwen3", config, 2)
    runs = run_distributed(checkpoint_round_trip, "qwen3", config, plan, str(tmp_path), timeout=240)
    first, last = (set(run["names"]) for run in runs)
    assert "model.layers.0.mlp.up_proj.weight" in first and "model.layers.0.mlp.up_proj.weight" not in last
    assert "model.norm.weight" in last and "model.norm.weight" not in first
    assert all(run["logits_error"] <= 1e-5 for run in runs)
    assert runs[0]["saved_keys_match"] and runs[0]["saved_error"] == 0.0  # transformers reads the whole model back
    assert runs[0]["dcp_error"] == 0.0  # the DCP checkpoint of two stages loads into the unsharded model


def test_a_checkpoint_of_two_stages_of_two_tensor_ranks_resumes_on_four_stages(tmp_path):
    from tests.support.pipeline_runs import lowered, resume_across_sizes

    config = dict(num_hidden_layers=4)
    plan_2x2 = _staged_plan("llama", config, 2, tp=2)
    generated = lowered("llama", plan_2x2, tmp_path)
    plan_4 = _staged_plan("llama", config, 4)
    errors = run_distributed(
        resume_across_sizes, plan_2x2, generated, plan_4, str(tmp_path / "dcp"), world_size=4, timeout=400
    )
    assert max(errors) <= 1e-5, errors
