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
