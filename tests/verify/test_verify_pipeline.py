"""``hpgen verify`` of the plans ``hpgen plan MODEL --pp 2`` (and ``--pp 2 --tp 2``) writes: exact.

The plans name the full config's layers on their stages (``model.layers.16-31``); verify's tiny
copy has two, one a stage. Each plan is proven on transformers' default attention (sdpa) and
on eager: the relay's logits, ``pipeline_step``'s loss and every stage's gradients against the
unsharded model, and greedy generation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

FLAGS = {"pp2": ["--pp", "2"], "pp2_tp2": ["--pp", "2", "--tp", "2"]}


def _written(tmp: Path, name: str) -> Path:
    from click.testing import CliRunner

    from hpgen.cli import cli

    path = tmp / f"{name}.json"
    result = CliRunner().invoke(cli, ["plan", "llama", *FLAGS[name], "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from hpgen.verify.prepare import prepare
    from hpgen.verify.run import verify_many

    folder = tmp_path_factory.mktemp("verify_pp")
    cases = []
    for name in FLAGS:
        plan = _written(folder, name)
        for attention in ("sdpa", "eager"):
            case = prepare(plan, folder / f"{name}_{attention}", model="llama", name=f"{name}_{attention}")
            if attention == "eager":  # the default (sdpa) is what the config carries; eager chosen as users choose it
                case.config._attn_implementation = "eager"
            cases.append(case)
    return {verdict.case.name: verdict for verdict in verify_many(cases, progress=False)}


@pytest.mark.parametrize("name", [f"{plan}_{attention}" for plan in FLAGS for attention in ("sdpa", "eager")])
def test_a_staged_plan_verifies_exact(verdicts: dict[str, Any], name: str) -> None:
    verdict = verdicts[name]
    for check in verdict.checks:
        print(f"{name}: {check.name}: {check.err:.2e} (tolerance {check.tol:.2e})")
    assert verdict.exact, verdict
    assert {"logits", "pipeline loss", "gradients", "greedy generation"} <= {check.name for check in verdict.checks}
    stages = json.loads(json.dumps(verdict.case.plan["pipeline"]["stages"]))
    assert stages[0][-1] == "model.layers.0" and stages[1][0] == "model.layers.1", stages  # one tiny layer a stage
    assert dict(verdict.case.mesh) == ({"pp": 2, "tp": 2} if "tp2" in name else {"pp": 2})


def test_more_stages_than_tiny_layers_grow_the_copy() -> None:
    """Four stages of an uneven cut on a two-layer copy: four layers, one a stage, the other modules kept in place;
    the copy's per-layer lists grow with it."""
    from transformers import Qwen3Config

    from hpgen.verify.shrink import more_layers, stages_for_layers

    plan = {"pipeline": {"axis": "pp", "stages": [["model.embed_tokens", "model.layers.0-9"], ["model.layers.10-15"],
                                                  ["model.layers.16-21"], ["model.layers.22-31", "model.norm", "lm_head"]]}}
    rewritten, count = stages_for_layers(plan, 2)
    assert count == 4
    assert rewritten["pipeline"]["stages"] == [["model.embed_tokens", "model.layers.0"], ["model.layers.1"],
                                               ["model.layers.2"], ["model.layers.3", "model.norm", "lm_head"]]
    assert stages_for_layers(plan, 6)[0]["pipeline"]["stages"][0] == ["model.embed_tokens", "model.layers.0-1"]
    config = Qwen3Config(num_hidden_layers=2)
    more_layers(config, count)
    assert config.num_hidden_layers == 4 and len(config.layer_types) == 4
