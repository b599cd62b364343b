"""The pre-commit hooks of .pre-commit-hooks.yaml, run by pre-commit itself.

A temporary git repository uses this repository as its hook source through
``pre-commit try-repo`` (which installs hpgen into a fresh hook environment, without
torch), commits a stale generated file, and shows the hooks failing and then passing.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import FIXTURES, ROOT

PYPROJECT = """[tool.hpgen]
targets = [{ source = "models/modeling_tiny.py", plan = "plans/tp.json", output = "gen/modeling_tiny_tp.py" }]
"""


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def pre_commit(repo: Path, hook: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pre_commit", "try-repo", str(ROOT), hook, "--all-files", "--verbose"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def hook_home(tmp_path_factory):
    """One pre-commit cache for the module, so the hook environment is built once."""
    return tmp_path_factory.mktemp("pre-commit-home")


def test_hooks_fail_on_a_stale_file_and_pass_after_regeneration(tmp_path, hook_home):
    repo = tmp_path / "repo"
    for folder in ("models", "plans", "gen"):
        (repo / folder).mkdir(parents=True)
    shutil.copy(FIXTURES / "modeling_tiny.py", repo / "models" / "modeling_tiny.py")
    shutil.copy(FIXTURES / "plan_tp.json", repo / "plans" / "tp.json")
    (repo / "pyproject.toml").write_text(PYPROJECT)
    # A generated file from another plan: committed, and stale for this one.
    subprocess.run(
        [sys.executable, "-m", "hpgen", "lower", "models/modeling_tiny.py", str(FIXTURES / "plan_tp_sp.json"), "-o", "gen/modeling_tiny_tp.py"],
        cwd=repo,
        check=True,
        capture_output=True,
    )
    env = {**os.environ, "PRE_COMMIT_HOME": str(hook_home), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    git(repo, "init", "-q")
    git(repo, "add", ".")
    subprocess.run(["git", "commit", "-qm", "stale"], cwd=repo, env=env, check=True)

    check = pre_commit(repo, "hpgen-check", env)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "hpgen check" in check.stdout and "Failed" in check.stdout
    assert "would regenerate gen/modeling_tiny_tp.py" in check.stdout

    lower = pre_commit(repo, "hpgen-lower", env)
    assert lower.returncode == 1, lower.stdout + lower.stderr
    assert "files were modified by this hook" in lower.stdout
    assert "wrote gen/modeling_tiny_tp.py" in lower.stdout

    again = pre_commit(repo, "hpgen-check", env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Passed" in again.stdout
