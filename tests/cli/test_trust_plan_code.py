"""``hpgen verify`` imports what a plan's injections name only when the user trusts it (``--trust-plan-code``,
``--trust-module``): otherwise exit 2 and one line naming the target and the flags, before any import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.models import load_plan_dict

REPO = Path(__file__).resolve().parents[2]
ZEN = "Beautiful is better than ugly"


def _plan_with(tmp_path: Path, target: object) -> Path:
    plan = load_plan_dict("llama_tp")
    plan["injections"] = [{"match": "model.layers.*.mlp", "local_compute_fn": target}]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def _verify(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "hpgen", "verify", *args], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )


@pytest.mark.parametrize(
    ("target", "named", "package"),
    [("this.s", "'this.s'", "this"), ({"_target_": "os.getcwd", "path": "/"}, "'os.getcwd'", "os")],
)
def test_an_untrusted_target_is_refused_before_it_is_imported(tmp_path: Path, target: object, named: str, package: str) -> None:
    done = _verify(tmp_path, str(_plan_with(tmp_path, target)), "llama")
    assert done.returncode == 2, done.stderr
    assert ZEN not in done.stdout + done.stderr  # `import this` never ran
    (line,) = [line for line in done.stderr.splitlines() if not line.startswith("hpgen verify: [")]
    assert line.startswith("error: ") and "plan.json: the injection for 'model.layers.*.mlp'" in line and named in line, line
    assert "--trust-plan-code" in line and f"--trust-module {package}" in line and "Traceback" not in done.stderr


def test_a_trusted_module_runs_on_the_ranks(tmp_path: Path) -> None:
    """The flag travels to the ranks: a user's local compute function (the MLP's own body, scaled by 1) is exact."""
    plan = _plan_with(tmp_path, {"_target_": "tests.local_fns.scaled_mlp", "scale": 1.0})
    done = _verify(tmp_path, str(plan), "llama", "--trust-module", "tests.local_fns")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "exact", done.stdout
