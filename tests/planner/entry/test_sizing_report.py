"""What a plan costs per rank, and what ``hpgen plan`` prints besides the plan (:mod:`hpgen.planner.entry.sizing_report`, :mod:`hpgen.planner.entry.printout`)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from hpgen.cli import cli
from tests.support.derived_configs import tiny
from tests.planner.plan_helpers import derived


def test_sizing_report_counts_bytes_and_collectives() -> None:
    from hpgen.planner.entry.sizing_report import size_report
    from hpgen.planner.model.load import meta_model

    model = meta_model(tiny("gpt2"))
    report = size_report(model, derived("gpt2"), tp=2, dtype="bfloat16")
    total = sum(p.numel() for p in model.parameters()) * 2
    assert report.total_bytes == total and report.sharded_bytes + report.replicated_bytes == total
    assert report.rank_bytes[0] + report.rank_bytes[1] == report.sharded_bytes + 2 * report.replicated_bytes
    assert report.layers == {"transformer.h.*": 2}
    forward = [c for c in report.per_layer["transformer.h.*"] if c.phase == "forward"]
    assert [(c.module, c.kind, c.tensor_bytes) for c in forward] == [
        ("transformer.h.*.attn", "all_reduce", 128),  # 64 features at 2 bytes, per token
        ("transformer.h.*.mlp", "all_reduce", 128),
    ]
    totals = report.totals("forward")
    # two per layer, the token embedding's and the learned positions' (64 rows: as big as half the vocabulary)
    assert totals["all_reduce"][0] == 2 * 2 + 2
    assert totals["all_gather"][0] == 1  # the logits: lm_head knows its out_features, no size exchange
    assert "encoder_hidden_states" in report.optional


def test_hpgen_plan_prints_the_notes_and_the_sizing_report(tmp_path: Path) -> None:
    config = tmp_path / "gpt2"
    tiny("gpt2").save_pretrained(config)
    result = CliRunner().invoke(
        cli, ["plan", str(config / "config.json"), "--tp", "2", "--explain"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["comments"]["plan_source"] == "derived from the source"
    assert "sharded: transformer.h.*.attn: attention: column- and row-parallel projections" in result.stderr
    assert "parameters at bfloat16" in result.stderr and "total per forward" in result.stderr


def test_the_sizing_report_is_at_the_checkpoints_dtype_unless_told(tmp_path: Path) -> None:
    """A float32 checkpoint is sized at float32 (its config's dtype), --dtype overrides it; the report says which."""
    from hpgen.planner.entry.sizing_report import format_bytes, size_report
    from hpgen.planner.model.load import meta_model

    config = tiny("gpt2")
    config.dtype = "float32"
    config.save_pretrained(tmp_path)
    path = str(tmp_path / "config.json")
    own = CliRunner().invoke(cli, ["plan", path, "--tp", "2"], catch_exceptions=False)
    told = CliRunner().invoke(cli, ["plan", path, "--tp", "2", "--dtype", "bfloat16"], catch_exceptions=False)
    assert own.exit_code == told.exit_code == 0, own.stderr + told.stderr
    assert "parameters at float32 (the config's dtype; --dtype to change): " in own.stderr
    assert "parameters at bfloat16 (--dtype): " in told.stderr
    sized = size_report(meta_model(config), json.loads(own.stdout), tp=2, dtype="float32")
    assert f"{format_bytes(sized.total_bytes)} unsharded" in own.stderr
    assert f"{format_bytes(sized.total_bytes // 2)} unsharded" in told.stderr


def test_hpgen_explain_adds_the_sizing_report_with_config(tmp_path: Path) -> None:
    import inspect

    from hpgen.planner.model.load import model_class_for

    config = tmp_path / "opt"
    tiny("opt").save_pretrained(config)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(derived("opt")))
    source = inspect.getsourcefile(model_class_for(tiny("opt")))
    result = CliRunner().invoke(
        cli, ["explain", str(source), str(plan), "--config", str(config / "config.json"), "--tp", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    sizing = json.loads(result.stdout)["sizing"]
    assert sizing["per_layer"]["model.decoder.layers.*"]["layers"] == 2
    assert sizing["parameters"]["rank_bytes"][0] < sizing["parameters"]["total_bytes"] * 0.65
