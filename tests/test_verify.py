"""``hpgen verify``: wrong plans caught and located, the plans ``hpgen plan`` writes proven exact.

Every case of ``tests/verify_corpus.py`` runs in ONE spawn of 2 gloo ranks
(:func:`hpgen.verify.run.verify_many`): the corpus costs one process start-up. One test
drives the real command line in a subprocess for the exit codes and ``--json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.verify_corpus import CORRECT, WRONG, written_plan

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from hpgen.verify.prepare import prepare
    from hpgen.verify.report import finding, planner_plan
    from hpgen.verify.run import verify_many

    folder = tmp_path_factory.mktemp("verify")
    cases = [prepare(wrong.plan(), folder / name, model=wrong.model_type, name=name) for name, wrong in WRONG.items()]
    cases += [
        prepare(written_plan(model_type, **dict(flags)), folder / name, model=model_type, name=name)
        for name, (model_type, flags) in CORRECT.items()
    ]
    found = {}
    for verdict in verify_many(cases, progress=False):
        located = None if verdict.exact else finding(verdict, planner_plan(verdict))
        found[verdict.case.name] = (verdict, located)
    return found


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_written_plans_are_exact(verdicts: dict[str, Any], name: str) -> None:
    verdict, located = verdicts[name]
    assert verdict.exact, located["message"] if located else verdict
    assert {check.name for check in verdict.checks} == {"logits", "gradients", "greedy generation"}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_wrong_plans_are_caught_and_located(verdicts: dict[str, Any], name: str) -> None:
    wrong = WRONG[name]
    verdict, located = verdicts[name]
    assert not verdict.exact  # proven wrong on 2 ranks: a difference, a crash or a refusal
    message = located["message"]
    if wrong.side == "parallelize":
        assert verdict.raised is not None and verdict.raised.refused, message
        assert wrong.fqn in message
        return
    if wrong.side == "raised":
        assert verdict.raised is not None and not verdict.raised.refused and verdict.raised.stage == "forward", message
    else:
        assert verdict.raised is None, message
        assert located["side"] == wrong.side, message
    assert located["fqn"].startswith(wrong.fqn), message
    assert located["fqn"] in message and located["cls"] in message
    if wrong.entry is not None:
        assert located["entry"] == wrong.entry, message
    # the planner reads the source otherwise, and says what it would declare
    assert located.get("planner"), message
    assert "hpgen plan would declare" in message, message


def test_the_report_names_the_partial_sum(verdicts: dict[str, Any]) -> None:
    _, located = verdicts["attention_out_R_for_P"]
    message = located["message"]
    assert message.startswith("model.layers.0.self_attn (LlamaAttention): forward: output attn_output differs")
    assert "out_src {attn_output tp R}" in message
    assert "did you mean out_src attn_output tp P(sum) (the body returns a partial sum: o_proj row-parallel)?" in message


def test_correct_gradients_only_differ_where_the_plan_is_wrong(verdicts: dict[str, Any]) -> None:
    # exact logits, 4 wrong gradients: the q/k norms of the two layers, nothing else
    verdict, _ = verdicts["qk_norm_missing_grad_reduce"]
    assert [check.ok for check in verdict.checks if check.name == "logits"] == [True]
    assert sorted(d.what.rsplit(".", 2)[-2] for d in verdict.params) == ["k_norm", "k_norm", "q_norm", "q_norm"]


def _hpgen(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpgen", *args], capture_output=True, text=True, cwd=cwd, timeout=240)


def test_the_command_line(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(WRONG["attention_out_R_for_P"].plan()))
    done = _hpgen("verify", str(plan), "llama", "--json", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["exact"] is False and report["mesh"] == {"tp": 2}
    assert report["finding"]["fqn"] == "model.layers.0.self_attn" and report["finding"]["side"] == "forward"
    stages = [line for line in done.stderr.splitlines() if line.startswith("hpgen verify:")]
    assert len(stages) >= 4, done.stderr  # a progress line per stage
    # bad input: exit 2, one line naming the file, no traceback
    bad = tmp_path / "bad.json"
    bad.write_text('{"mesh_dim_names": ["tp"], "param_plan": {"x": {"out_src": {"output": {"tp": "S(x)"}}}}}')
    for args, where in (((str(bad), "llama"), "bad.json"), ((str(plan), "no_such_model_type"), "no_such_model_type"),
                        ((str(plan), "llama", "--ranks", "0"), "--ranks")):
        done = _hpgen("verify", *args, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and where in done.stderr, done.stderr
