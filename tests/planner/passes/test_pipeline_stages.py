"""``hpgen plan --pp``: stages balanced by parameters, chosen by hand, shown, and refused where they cannot be."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hpgen.cli import cli
from hpgen.core.plan import plan_from_dict
from hpgen.planner.passes.pipeline_stages import stage_cut
from tests.support.models import make_config


def _meta(family: str, **overrides):
    from hpgen.planner.model.load import meta_model

    return meta_model(make_config(family, **overrides))


def _plan(*args: str):
    result = CliRunner().invoke(cli, ["plan", *map(str, args)], catch_exceptions=False)
    return result


def test_the_cut_balances_parameters_with_the_embedding_and_head_counted():
    # 8 layers, a vocabulary worth about 2 layers on each end: the end stages get fewer layers
    model = _meta("llama", num_hidden_layers=8, vocab_size=1200)
    cut = stage_cut(model, 4)
    assert sum(cut.layers) == 8 and cut.layers[0] < cut.layers[1] and cut.layers[3] < cut.layers[2]
    assert cut.stages[0][0] == "model.embed_tokens" and cut.stages[-1][-2:] == ("model.norm", "lm_head")
    # no other contiguous cut of 8 layers into 4 stages has a smaller largest stage
    import itertools

    others = [
        max(stage_cut(model, 4, layers=[b - a for a, b in zip((0, *ends), (*ends, 8))]).params)
        for ends in itertools.combinations(range(1, 8), 3)
    ]
    assert max(cut.params) == min(others)


def test_a_tied_table_counts_on_both_end_stages():
    model = _meta("qwen3", num_hidden_layers=4, tie_word_embeddings=True)
    cut = stage_cut(model, 2, layers=[2, 2])
    table = model.model.embed_tokens.weight.numel()
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    norm = model.model.norm.weight.numel()
    assert cut.params == (table + 2 * layer, 2 * layer + norm + table)


def test_plan_pp_with_tp_writes_pp_outermost_and_loads(tmp_path):
    result = _plan("llama", "--pp", "4", "--tp", "2", "--pp-layers", "10,6,6,10", "--explain", "-o", tmp_path / "p.json")
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "p.json").read_text())
    assert document["mesh_dim_names"] == ["pp", "tp"]
    assert document["pipeline"]["stages"][0] == ["model.embed_tokens", "model.layers.0-9"]
    assert document["pipeline"]["stages"][3] == ["model.layers.22-31", "model.norm", "lm_head"]
    plan = plan_from_dict(document)
    assert plan.pipeline.stage_of("model.layers.17.mlp") == 2 and plan.pipeline.stage_of("model.rotary_emb") is None
    assert "pipeline stage 3: model.layers.22-31, model.norm, lm_head (" in result.output  # --explain: parameters


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pp", "40"], "32 decoder layers (model.layers) cannot fill 40 stages"),
        (["--pp", "2", "--pp-layers", "3,5"], "give 2 positive counts adding up to the 32 decoder layers"),
        (["--pp", "2", "--pp-layers", "x"], "expected comma-separated layer counts"),
        (["--pp", "2", "--cp", "2"], "--pp: not with --cp"),
        (["--pp", "2", "--tp", "2", "--sp"], "--pp: not with --sp"),
        (["--pp-layers", "16,16"], "--pp-layers: give --pp N too"),
    ],
)
def test_what_cannot_be_staged_is_refused_in_one_line(tmp_path, args, message):
    result = _plan("llama", *args, "-o", tmp_path / "p.json")
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "p.json").exists()


def test_explain_lists_the_stages_of_an_edited_plan(tmp_path):
    from tests.support.models import FAMILIES

    assert _plan("llama", "--pp", "2", "-o", tmp_path / "p.json").exit_code == 0
    document = json.loads((tmp_path / "p.json").read_text())
    document["pipeline"]["stages"] = [["model.embed_tokens", "model.layers.0-2"], ["model.layers.3-31", "model.norm", "lm_head"]]
    (tmp_path / "p.json").write_text(json.dumps(document))
    result = CliRunner().invoke(cli, ["explain", str(FAMILIES["llama"].source()), str(tmp_path / "p.json")], catch_exceptions=False)
    assert result.exit_code == 0
    assert "pipeline stage 0: model.embed_tokens, model.layers.0-2\n" in result.output
