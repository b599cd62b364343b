"""[tool.hpgen] targets, `hpgen lower` without arguments, and `hpgen check` (docs/cli.md)."""

import os
import shutil

import pytest
from click.testing import CliRunner

import hpgen.generator.generate
from hpgen.cli import cli

from tests.conftest import FIXTURES, PLANS

PYPROJECT = """
[project]
name = "demo"

[tool.hpgen]
targets = [
  { source = "models/modeling_tiny.py", plan = "plans/tp.json", output = "gen/modeling_tiny_tp.py" },
  { source = "models/modeling_tiny.py", plan = "plans/tp_sp.json", output = "gen/modeling_tiny_sp.py", mode = "toggle" },
]
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project with two targets; the cwd is a subfolder, as when run from anywhere inside.
    The output folder ``gen/`` does not exist yet, as in a fresh checkout: lower makes it."""
    (tmp_path / "models").mkdir()
    (tmp_path / "plans").mkdir()
    (tmp_path / "deep" / "er").mkdir(parents=True)
    shutil.copy(FIXTURES / "modeling_tiny.py", tmp_path / "models" / "modeling_tiny.py")
    shutil.copy(FIXTURES / "plan_tp.json", tmp_path / "plans" / "tp.json")
    shutil.copy(FIXTURES / "plan_tp_sp.json", tmp_path / "plans" / "tp_sp.json")
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    monkeypatch.chdir(tmp_path / "deep" / "er")
    return tmp_path


def run_hpgen(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_lower_regenerates_every_target_and_writes_only_changed_files(project):
    first = run_hpgen("lower")
    assert first.exit_code == 0, first.output
    assert first.stderr.splitlines() == [
        "wrote ../../gen/modeling_tiny_tp.py",
        "wrote ../../gen/modeling_tiny_sp.py",
        "2 written",
    ]
    sp = project / "gen" / "modeling_tiny_sp.py"
    assert "if self.tp_enable:" in sp.read_text()
    stamp = sp.stat().st_mtime_ns - 10**9
    os.utime(sp, ns=(stamp, stamp))
    (project / "plans" / "tp.json").write_text((project / "plans" / "tp.json").read_text().replace('"R"', ' "R"', 1))
    second = run_hpgen("lower")
    assert second.stderr.splitlines() == ["wrote ../../gen/modeling_tiny_tp.py", "1 written, 1 unchanged"]
    assert sp.stat().st_mtime_ns == stamp


def test_check_passes_on_fresh_targets_without_lowering_them(project, monkeypatch):
    run_hpgen("lower")

    def refuse(target):
        raise AssertionError("a fresh target was lowered again")

    monkeypatch.setattr(hpgen.generator.generate, "generate", refuse)
    result = run_hpgen("check")
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and result.stderr == "2 up to date\n"


@pytest.mark.parametrize(
    "change",
    ["missing output", "hand edit", "source changed", "plan changed", "version changed", "header removed"],
)
def test_check_finds_stale_targets_with_a_diff(project, change):
    run_hpgen("lower")
    output = project / "gen" / "modeling_tiny_tp.py"
    text = output.read_text()
    if change == "missing output":
        output.unlink()
    elif change == "hand edit":
        output.write_text(text.replace("self._hp_tp.all_reduce(outputs[0])", "outputs[0]"))
    elif change == "source changed":
        source = project / "models" / "modeling_tiny.py"
        source.write_text(source.read_text().replace("# gated, as in Llama", "# gated"))
    elif change == "plan changed":
        plan = project / "plans" / "tp.json"
        plan.write_text(plan.read_text().replace('"lm_head": {', '"lm_head": {"is_boundary": true,'))
    elif change == "version changed":
        output.write_text(text.replace("hpgen 0.1.0:", "hpgen 0.0.9:"))
    else:
        output.write_text(text.split("\n", 6)[6])
    result = run_hpgen("check")
    assert result.exit_code == 1, result.output
    assert "would regenerate ../../gen/modeling_tiny_tp.py" in result.stderr
    both = change == "source changed"  # the two targets share the source
    assert result.stderr.endswith("2 stale\n" if both else "1 stale, 1 up to date\n")
    assert result.stdout.startswith("--- ../../gen/modeling_tiny_tp.py\n+++ ../../gen/modeling_tiny_tp.py (hpgen)\n")
    assert "\x1b[" not in result.stdout  # not a terminal: no colour
    if change != "missing output":
        assert output.read_text() != ""  # check never writes
    run_hpgen("lower")
    assert run_hpgen("check").exit_code == 0


def test_check_selected_outputs_and_colour(project):
    run_hpgen("lower")
    output = project / "gen" / "modeling_tiny_sp.py"
    output.write_text(output.read_text() + "# edit\n")
    only_fresh = run_hpgen("check", "../../gen/modeling_tiny_tp.py")
    assert only_fresh.exit_code == 0 and only_fresh.stderr == "1 up to date\n"
    coloured = run_hpgen("check", "--color", "../../gen/modeling_tiny_sp.py")
    assert coloured.exit_code == 1 and "\x1b[31m-# edit" in coloured.stdout
    unknown = run_hpgen("check", "nowhere.py")
    assert unknown.exit_code == 2 and "nowhere.py is not the output of any target" in unknown.stderr


def test_full_check_lowers_again(project, monkeypatch):
    run_hpgen("lower")
    calls = []
    original = hpgen.generator.generate.generate
    monkeypatch.setattr(hpgen.generator.generate, "generate", lambda target: calls.append(target) or original(target))
    assert run_hpgen("check", "--full").exit_code == 0
    assert len(calls) == 2


@pytest.mark.parametrize(
    ("pyproject", "expected"),
    [
        ("[tool.hpgen\n", "pyproject.toml: invalid TOML: "),
        ("[tool.hpgen]\ntarget = []\n", "pyproject.toml:tool.hpgen.target: unknown key 'target'"),
        ("[tool.hpgen]\ntargets = []\n", "pyproject.toml:tool.hpgen.targets: expected a non-empty list"),
        ("[tool.hpgen]\ntargets = [1]\n", "tool.hpgen.targets[0]: expected a table"),
        (
            '[tool.hpgen]\ntargets = [{source = "models/nope.py", plan = "plans/tp.json", output = "o.py"}]\n',
            "tool.hpgen.targets[0].source: no such file: models/nope.py",
        ),
        (
            '[tool.hpgen]\ntargets = [{source = "models/modeling_tiny.py", plan = "plans/tp.json"}]\n',
            "tool.hpgen.targets[0].output: 'output' must be a path",
        ),
        (
            '[tool.hpgen]\ntargets = [{source = "models/modeling_tiny.py", plan = "plans/tp.json", output = "o.py", modes = "x"}]\n',
            "tool.hpgen.targets[0].modes: unknown key 'modes'",
        ),
        (
            '[tool.hpgen]\ntargets = [{source = "models/modeling_tiny.py", plan = "plans/tp.json", output = "o.py", mode = "fast"}]\n',
            "tool.hpgen.targets[0].mode: mode 'fast' is not one of default, toggle",
        ),
        (
            '[tool.hpgen]\ntargets = [{source = "models/modeling_tiny.py", plan = "plans/tp.json", output = "models/modeling_tiny.py"}]\n',
            "tool.hpgen.targets[0].output: the output would overwrite the source",
        ),
    ],
)
def test_bad_target_lists_exit_2_with_the_place(project, pyproject, expected):
    """A table that does not parse is one line; a bad entry is its line and the summary's."""
    (project / "pyproject.toml").write_text(pyproject)
    for command in (["lower"], ["check"]):
        result = run_hpgen(*command)
        assert result.exit_code == 2, result.output
        assert expected in result.stderr
        lines = result.stderr.splitlines()
        assert lines == [lines[0]] if "targets[" not in expected else lines[1:] == ["1 failed"], lines
    assert not (project / "gen").exists()  # nothing written, not even the output folder


def test_every_target_is_tried_and_each_bad_one_reported(project):
    """A first target naming a missing plan, a second that is fine, a third with an unknown key:
    the second is written (and checked), the other two reported in their turn, exit 2."""
    (project / "pyproject.toml").write_text(
        "[tool.hpgen]\ntargets = [\n"
        '  { source = "models/modeling_tiny.py", plan = "plans/nope.json", output = "gen/a.py" },\n'
        '  { source = "models/modeling_tiny.py", plan = "plans/tp.json", output = "gen/b.py" },\n'
        '  { source = "models/modeling_tiny.py", plan = "plans/tp.json", output = "gen/c.py", modes = "x" },\n'
        "]\n"
    )
    lowered = run_hpgen("lower")
    assert lowered.exit_code == 2
    assert lowered.stderr.splitlines() == [
        f"error: {project / 'pyproject.toml'}:tool.hpgen.targets[0].plan: no such file: plans/nope.json",
        "wrote ../../gen/b.py",
        f"error: {project / 'pyproject.toml'}:tool.hpgen.targets[2].modes: unknown key 'modes' "
        "(allowed: mode, output, package, plan, source)",
        "1 written, 2 failed",
    ]
    assert sorted(path.name for path in (project / "gen").iterdir()) == ["b.py"]
    checked = run_hpgen("check")
    assert checked.exit_code == 2 and checked.stderr.splitlines()[-1] == "1 up to date, 2 failed", checked.stderr
    named = run_hpgen("check", "../../gen/a.py")  # only the named target, and it is the bad one
    assert named.exit_code == 2 and "plans/nope.json" in named.stderr and "1 failed" in named.stderr
    assert run_hpgen("check", "../../gen/b.py").exit_code == 0


def test_exit_non_zero_on_write_fails_whenever_a_file_is_written(project):
    """What the pre-commit hook runs: exit 1 when a file was written (here created), 0 when nothing was."""
    first = run_hpgen("lower", "--exit-non-zero-on-write")
    assert first.exit_code == 1 and first.stderr.splitlines()[-1] == "2 written"
    assert run_hpgen("lower", "--exit-non-zero-on-write").exit_code == 0


def test_no_pyproject_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_hpgen("check")
    assert result.exit_code == 2
    assert "no pyproject.toml with a [tool.hpgen] table" in result.stderr


def test_one_bad_target_does_not_stop_the_others(project):
    (project / "plans" / "tp_sp.json").write_text("{")
    result = run_hpgen("lower")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "wrote ../../gen/modeling_tiny_tp.py"
    assert "tp_sp.json:1:2: invalid JSON" in lines[1]
    assert lines[2] == "1 written, 1 failed"
    assert not (project / "gen" / "modeling_tiny_sp.py").exists()


def test_relative_paths_in_the_pyproject_are_relative_to_it(project, monkeypatch):
    monkeypatch.chdir(project)
    assert run_hpgen("lower").stderr.splitlines()[0] == "wrote gen/modeling_tiny_tp.py"


def test_check_on_fresh_targets_does_not_import_the_lowering_machinery(project):
    """The fast path answers from verified hashes; libcst is imported only to lower."""
    import subprocess
    import sys

    run_hpgen("lower")
    script = (
        "import sys; from click.testing import CliRunner; from hpgen.cli import cli; "
        "result = CliRunner().invoke(cli, ['check']); assert result.exit_code == 0, result.output; "
        "print('libcst' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
