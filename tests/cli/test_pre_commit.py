"""The pre-commit hooks of .pre-commit-hooks.yaml, and the configs docs/cli.md shows, run by pre-commit itself.

A temporary git repository uses this repository as its hook source through
docs/cli.md's ``rev: <commit sha>`` config, filled in (pre-commit installs hpgen into a
hook environment of its own, without torch, from that commit; uncommitted changes are
committed in a shadow clone first, as ``pre-commit try-repo`` does), commits a stale
generated file, and shows the hooks failing and then passing. The three runs share one
pre-commit home, so the hook environment is built once (``try-repo`` would build it for
each run). The documented ``repo: local`` config runs the hpgen installed in the environment.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, ROOT

PYPROJECT = """[tool.hpgen]
targets = [{ source = "models/modeling_tiny.py", plan = "plans/tp.json", output = "gen/modeling_tiny_tp.py" }]
"""


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def git_output(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def hook_source(folder: Path) -> tuple[str, str]:
    """This repository and its HEAD commit; with uncommitted changes to tracked files, a shadow clone
    (under ``folder``) and a commit of the working tree there, as ``pre-commit try-repo`` makes."""
    head = git_output(ROOT, "rev-parse", "HEAD")
    changed = git_output(ROOT, "diff", "--name-only", "--no-renames", "HEAD").splitlines()
    if not changed:
        return str(ROOT), head
    shadow = folder / "shadow"
    git(folder, "clone", "-q", str(ROOT), str(shadow))
    git(shadow, "checkout", "-q", head)
    for name in changed:
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, shadow / name)
        else:
            (shadow / name).unlink()
    git(shadow, "add", "-A")
    git(shadow, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--no-verify", "-m", "uncommitted changes")
    return str(shadow), git_output(shadow, "rev-parse", "HEAD")


def pre_commit(repo: Path, hook: str, env: dict[str, str], config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pre_commit", "run", "--config", str(config), hook, "--all-files", "--verbose"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def stale_project(tmp_path: Path) -> Path:
    """A project with one [tool.hpgen] target whose generated file, from another plan, is stale."""
    repo = tmp_path / "repo"
    for folder in ("models", "plans", "gen"):
        (repo / folder).mkdir(parents=True)
    shutil.copy(FIXTURES / "modeling_tiny.py", repo / "models" / "modeling_tiny.py")
    shutil.copy(FIXTURES / "plan_tp.json", repo / "plans" / "tp.json")
    (repo / "pyproject.toml").write_text(PYPROJECT)
    subprocess.run(
        [sys.executable, "-m", "hpgen", "lower", "models/modeling_tiny.py", str(FIXTURES / "plan_tp_sp.json"), "-o", "gen/modeling_tiny_tp.py"],
        cwd=repo,
        check=True,
        capture_output=True,
    )
    return repo


def test_hooks_fail_on_a_stale_file_and_pass_after_regeneration(tmp_path):
    repo = stale_project(tmp_path)
    # docs/cli.md's config of the repository's own hooks, filled in, with its read-only alternative too
    (remote,) = [config for config in _documented_configs() if "repo: local" not in config]
    source, rev = hook_source(tmp_path)
    filled = remote.replace("<this repository's URL>", source).replace("<commit sha>", rev)
    filled = filled.replace("# - id: hpgen-check  # read-only alternative", "- id: hpgen-check")
    config = tmp_path / "pre-commit-config.yaml"  # outside the project's repository, which it would change
    config.write_text(filled)
    # one pre-commit home for the three runs: the hook environment is built once
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "home"), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    git(repo, "init", "-q")
    git(repo, "add", ".")
    subprocess.run(["git", "commit", "-qm", "stale"], cwd=repo, env=env, check=True)

    check = pre_commit(repo, "hpgen-check", env, config)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "hpgen check" in check.stdout and "Failed" in check.stdout
    assert "would regenerate gen/modeling_tiny_tp.py" in check.stdout

    lower = pre_commit(repo, "hpgen-lower", env, config)
    assert lower.returncode == 1, lower.stdout + lower.stderr
    assert "files were modified by this hook" in lower.stdout
    assert "wrote gen/modeling_tiny_tp.py" in lower.stdout

    again = pre_commit(repo, "hpgen-check", env, config)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Passed" in again.stdout


def _documented_configs() -> list[str]:
    """The ``.pre-commit-config.yaml`` blocks of docs/cli.md."""
    text = (ROOT / "docs" / "cli.md").read_text()
    return [block for block in re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M) if block.startswith("repos:")]


def test_the_documented_local_hook_runs_the_installed_hpgen(tmp_path: Path) -> None:
    """docs/cli.md's ``repo: local`` config, verbatim, in a fresh repository: no hook environment to build."""
    (local,) = [config for config in _documented_configs() if "repo: local" in config]
    repo = stale_project(tmp_path)
    (repo / ".pre-commit-config.yaml").write_text(local)
    # the hpgen of this environment on PATH, as an activated environment has it
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PRE_COMMIT_HOME": str(tmp_path / "home"), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    git(repo, "init", "-q")
    git(repo, "add", ".")

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pre_commit", "run", "--all-files"], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=300)

    first = run()  # the output is stale: the hook regenerates it and fails the commit
    assert first.returncode == 1, first.stdout + first.stderr
    assert "hpgen lower" in first.stdout and "files were modified by this hook" in first.stdout
    assert "wrote gen/modeling_tiny_tp.py" in first.stdout
    git(repo, "add", ".")
    again = run()
    assert again.returncode == 0 and "Passed" in again.stdout, again.stdout + again.stderr


def test_the_hook_fails_when_it_creates_a_file(tmp_path: Path) -> None:
    """A fresh repository whose [tool.hpgen] output does not exist yet: pre-commit only sees changes to
    tracked files, so a hook that merely creates the file would let the commit land with it untracked.
    The documented hook (the same command as the repository's hpgen-lower) fails; after ``git add`` it passes."""
    import yaml

    (local,) = [config for config in _documented_configs() if "repo: local" in config]
    (documented,) = yaml.safe_load(local)["repos"][0]["hooks"]
    offered = {hook["id"]: hook for hook in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}
    assert documented["entry"] == offered["hpgen-lower"]["entry"] == "hpgen lower --exit-non-zero-on-write"
    repo = stale_project(tmp_path)
    shutil.rmtree(repo / "gen")  # nothing generated yet
    (repo / ".pre-commit-config.yaml").write_text(local)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PRE_COMMIT_HOME": str(tmp_path / "home"), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    git(repo, "init", "-q")
    git(repo, "add", ".")
    subprocess.run([sys.executable, "-m", "pre_commit", "install"], cwd=repo, env=env, check=True, capture_output=True)
    first = subprocess.run(["git", "commit", "-m", "first"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 1, first.stdout + first.stderr  # the commit does not land
    said = first.stdout + first.stderr  # git passes the hook's output on to stderr
    assert "hpgen lower" in said and "Failed" in said and "- exit code: 1" in said and "wrote gen/modeling_tiny_tp.py" in said
    assert (repo / "gen" / "modeling_tiny_tp.py").is_file()
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True).returncode != 0  # no commit
    git(repo, "add", ".")
    again = subprocess.run(["git", "commit", "-m", "first"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "Passed" in again.stdout + again.stderr, again.stdout + again.stderr


def test_the_documented_remote_hooks_name_hooks_the_repository_has(tmp_path: Path) -> None:
    """The ``rev: <commit sha>`` config is valid once filled in, and names hooks of .pre-commit-hooks.yaml
    (the first test above runs those hooks from a commit through such a config)."""
    import yaml

    (remote,) = [config for config in _documented_configs() if "repo: local" not in config]
    assert "rev: <commit sha>" in remote and "v0." not in remote  # no tag: the repository has none
    assert "pip install hpgen " not in (ROOT / "docs" / "cli.md").read_text()  # not on the package index
    filled = remote.replace("<this repository's URL>", str(ROOT)).replace("<commit sha>", "d3adb33f" * 5)
    (tmp_path / "config.yaml").write_text(filled)
    valid = subprocess.run([sys.executable, "-m", "pre_commit", "validate-config", str(tmp_path / "config.yaml")],
                           capture_output=True, text=True, timeout=120)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    offered = {hook["id"] for hook in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}
    named = {hook["id"] for hook in yaml.safe_load(filled)["repos"][0]["hooks"]}
    assert named and named <= offered
