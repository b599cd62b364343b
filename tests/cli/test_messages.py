"""What a newcomer's mistakes print: one line that says what to do, exit 2, nothing written.

A misspelt module path or model type gets the close names; ``hpgen plan`` without
torch/transformers names the extra; a relative import without a package names the flag
and the ``[tool.hpgen]`` key; one bad plan behind two targets is said once; a placement
naming a dim its parameter lacks is refused at ``lower`` time where the source says the
dims; the sizing report speaks of size exchanges only where a gather makes one.
(``parallelize``'s own messages are in tests/runtime/install/test_parallelize_errors.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpgen.cli import cli

from tests.conftest import FIXTURES, PLANS, ROOT


def hpgen(*args: str, cwd: Path | None = None) -> CliRunner:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def plan_with(tmp_path: Path, name: str, edit) -> Path:
    plan = json.loads((FIXTURES / "plan_tp.json").read_text())
    edit(plan)
    path = tmp_path / name
    path.write_text(json.dumps(plan, indent=2))
    return path


def test_a_misspelt_module_path_gets_the_close_name(tmp_path: Path) -> None:
    def misspell(plan):
        plan["param_plan"]["model.layers.*.self_atn"] = plan["param_plan"].pop("model.layers.*.self_attn")

    plan = plan_with(tmp_path, "typo.json", misspell)
    result = hpgen("lower", str(FIXTURES / "modeling_tiny.py"), str(plan))
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert 'typo.json:param_plan["model.layers.*.self_atn"]' in result.stderr
    assert "assigns no submodule 'self_atn' (did you mean 'model.layers.*.self_attn'?)" in result.stderr
    assert "boundary_classes" not in result.stderr  # the fix is the spelling, not a class table


def test_a_path_with_nothing_close_still_points_at_boundary_classes(tmp_path: Path) -> None:
    def unknown(plan):
        plan["param_plan"]["model.layers.*.zzz"] = plan["param_plan"].pop("model.layers.*.self_attn")

    result = hpgen("lower", str(FIXTURES / "modeling_tiny.py"), str(plan_with(tmp_path, "zzz.json", unknown)))
    assert result.exit_code == 2
    assert "did you mean" not in result.stderr and "add it to boundary_classes" in result.stderr


def test_a_misspelt_model_type_gets_the_close_name() -> None:
    result = hpgen("plan", "lama", "--tp", "2")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (
        "error: 'lama' is neither a config.json path nor a model type of the installed transformers "
        "(did you mean 'llama'?)\n"
    )


# A generator-only install: torch and transformers cannot be imported at all.
_BLOCKER = """
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "llama", "--tp", "2"],
        ["explain", str(FIXTURES / "modeling_tiny.py"), str(FIXTURES / "plan_tp.json"), "--config", "llama"],
        ["verify", str(ROOT / "tests" / "plans" / "llama_tp.json")],
    ],
    ids=["plan", "explain-config", "verify"],
)
def test_without_torch_and_transformers_the_plan_commands_name_the_extra(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "hpgen", *args], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    command = {"plan": "hpgen plan", "explain": "hpgen explain --config", "verify": "hpgen verify"}[args[0]]
    missing = "torch" if args[0] == "verify" else "transformers"  # the first of the two each command imports
    assert done.stderr == (
        f"error: {command} needs torch and transformers, and {missing} is not installed: "
        "pip install -e '.[plan]' in a clone of the hpgen repository\n"
    )
    # the generator itself still works there
    lowered = subprocess.run(
        [sys.executable, "-m", "hpgen", "lower", str(FIXTURES / "modeling_tiny.py"), str(FIXTURES / "plan_tp.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert lowered.returncode == 0 and "_hp_tp.all_reduce" in lowered.stdout, lowered.stderr


RELATIVE = textwrap.dedent(
    """\
    from torch import nn

    from ...activations import ACT2FN


    class TinyForCausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.lm_head = nn.Linear(4, 8)
    """
)
LM_HEAD_PLAN = {
    "mesh_dim_names": ["tp"],
    "param_plan": {"lm_head": {"out_src": {"output": {"tp": "S(-1)"}}, "out_dst": {"output": {"tp": "R"}},
                               "params": {"weight": {"tp": "S(0)"}}}},
}


def _relative_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "modeling_rel.py").write_text(RELATIVE)
    (tmp_path / "plan.json").write_text(json.dumps(LM_HEAD_PLAN))
    (tmp_path / "pyproject.toml").write_text(
        '[tool.hpgen]\ntargets = [{ source = "src/modeling_rel.py", plan = "plan.json", output = "gen/rel_tp.py" }]\n'
    )
    monkeypatch.chdir(tmp_path)


def test_a_relative_import_without_a_package_names_the_flag_and_the_key(tmp_path, monkeypatch) -> None:
    _relative_project(tmp_path, monkeypatch)
    targets = hpgen("lower")
    assert targets.exit_code == 2 and not (tmp_path / "gen").exists()
    assert "src/modeling_rel.py:3:1: a relative import needs the source's package" in targets.stderr
    assert "give the target its package key, " in targets.stderr
    assert 'pyproject.toml:tool.hpgen.targets[0]: package = "transformers.models.llama"' in targets.stderr
    assert "(on the command line: --package PKG)" in targets.stderr
    single = hpgen("lower", "src/modeling_rel.py", "plan.json", "-o", "gen/one.py")
    assert single.exit_code == 2 and not (tmp_path / "gen").exists()
    assert "pass --package PKG (in a [tool.hpgen] target: its package key, package = " in single.stderr
    fixed = Path("pyproject.toml").read_text().replace('output = "gen/rel_tp.py"', 'output = "gen/rel_tp.py", package = "pkg.models.rel"')
    Path("pyproject.toml").write_text(fixed)
    assert hpgen("lower").exit_code == 0
    assert "from pkg.activations import ACT2FN" in (tmp_path / "gen" / "rel_tp.py").read_text()


def test_one_bad_plan_behind_two_targets_is_said_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copy(FIXTURES / "modeling_tiny.py", tmp_path / "modeling_tiny.py")
    plan = json.loads((FIXTURES / "plan_tp.json").read_text())
    plan["param_plan"]["model.layers.*.mlp"]["out_src"]["output"]["tp"] = "S(x)"
    (tmp_path / "bad.json").write_text(json.dumps(plan))
    shutil.copy(FIXTURES / "plan_tp.json", tmp_path / "good.json")
    (tmp_path / "pyproject.toml").write_text(
        "[tool.hpgen]\ntargets = [\n"
        '  { source = "modeling_tiny.py", plan = "bad.json", output = "gen/a.py" },\n'
        '  { source = "modeling_tiny.py", plan = "good.json", output = "gen/b.py" },\n'
        '  { source = "modeling_tiny.py", plan = "bad.json", output = "gen/c.py", mode = "toggle" },\n'
        "]\n"
    )
    monkeypatch.chdir(tmp_path)
    result = hpgen("lower")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert sum("'S(x)' is not a placement" in line for line in lines) == 1, result.stderr
    assert lines == [
        "error: bad.json:param_plan[\"model.layers.*.mlp\"].out_src.output.tp: 'S(x)' is not a placement "
        "(expected R, S(d), S(d,u), S(d,u,g), P(op), SS(d,k), RS(d,r) or B(d, n1:P1, n2:P2, ...))",
        "wrote gen/b.py",
        "error: gen/c.py: not written, the same error as gen/a.py",
        "1 written, 2 failed",
    ], result.stderr


@pytest.mark.parametrize("command", ["lower", "explain"])
def test_a_placement_naming_a_dim_the_weight_lacks_is_refused_at_lower_time(tmp_path: Path, command: str) -> None:
    def five(plan):
        plan["param_plan"]["model.layers.*.mlp"]["params"]["down_proj.weight"] = {"tp": "S(5)"}

    plan = plan_with(tmp_path, "s5.json", five)
    output = tmp_path / "out.py"
    args = [command, str(FIXTURES / "modeling_tiny.py"), str(plan)] + (["-o", str(output)] if command == "lower" else [])
    result = hpgen(*args)
    assert result.exit_code == 2 and result.stdout == "" and not output.exists()
    assert result.stderr == (
        f'error: {plan}:param_plan["model.layers.*.mlp"].params["down_proj.weight"].tp: S(5) names dim 5, but '
        f"down_proj.weight has 2 dims (nn.Linear at {FIXTURES / 'modeling_tiny.py'}:121); a placement's dim is "
        "one of -2, -1, 0, 1\n"
    )


def test_the_dims_of_nn_parameter_factories_are_read_from_init(tmp_path: Path) -> None:
    source = tmp_path / "modeling_scale.py"
    source.write_text(
        textwrap.dedent(
            """\
            import torch
            from torch import nn


            class Scale(nn.Module):
                def __init__(self, config):
                    super().__init__()
                    self.weight = nn.Parameter(torch.ones((config.heads, config.head_dim)))
                    self.shift = nn.Parameter(torch.zeros(config.size))  # a name: maybe a whole size tuple

                def forward(self, x):
                    return x * self.weight.flatten() + self.shift


            class ScaleForCausalLM(nn.Module):
                def __init__(self, config):
                    super().__init__()
                    self.scale = Scale(config)
            """
        )
    )
    entry = {"in_src": {"x": {"tp": "R"}}, "in_dst": {"x": {"tp": "R"}}, "out_src": {"output": {"tp": "P(sum)"}},
             "out_dst": {"output": {"tp": "R"}}, "params": {"weight": {"tp": "S(2)"}, "shift": {"tp": "S(3)"}}}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"mesh_dim_names": ["tp"], "param_plan": {"scale": entry}}))
    result = hpgen("lower", str(source), str(plan))
    assert result.exit_code == 2
    assert f'params["weight"].tp: S(2) names dim 2, but weight has 2 dims' in result.stderr
    assert f"(nn.Parameter(torch.<factory>(...)) at {source}:8)" in result.stderr
    entry["params"]["weight"] = {"tp": "S(-1)"}
    plan.write_text(json.dumps({"mesh_dim_names": ["tp"], "param_plan": {"scale": entry}}))
    # shift's dims are not known statically (torch.zeros(config.size)): left to parallelize
    assert hpgen("lower", str(source), str(plan)).exit_code == 0
    # an entry that only shards parameters (no rewrite) is checked too
    only_params = {"params": {"weight": {"tp": "S(-3)"}}}
    plan.write_text(json.dumps({"mesh_dim_names": ["tp"], "param_plan": {"scale": only_params}}))
    result = hpgen("lower", str(source), str(plan))
    assert result.exit_code == 2 and 'param_plan["scale"].params["weight"].tp: S(-3) names dim -3' in result.stderr


def _llama_sizing(plan: Path, tmp_path: Path) -> tuple[str, str]:
    """``hpgen explain`` of modeling_llama.py under ``plan`` with the sizing report of a small Llama."""
    from transformers import LlamaConfig

    from tests.conftest import transformers_modeling_file

    config = tmp_path / "config.json"
    LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4).to_json_file(config)
    result = hpgen("explain", str(transformers_modeling_file("llama")), str(plan), "--config", str(config))
    assert result.exit_code == 0, result.stderr
    explained, _, sizing = result.stdout.partition("parameters at bfloat16")
    return explained, sizing


def test_the_sizing_report_speaks_of_size_exchanges_only_when_a_gather_makes_one(tmp_path: Path) -> None:
    explained, sizing = _llama_sizing(PLANS / "llama_tp_vocab.json", tmp_path)
    assert "all_gather" in sizing and "from the weight's shape" in explained  # lm_head: sizes from out_features
    assert "exchange" not in sizing
    # the MLP gathers its input's features, which nothing in the forward splits: it must exchange the sizes
    plan = json.loads((PLANS / "llama_tp_vocab.json").read_text())
    plan["param_plan"]["model.layers.*.mlp"]["in_src"] = {"x": {"tp": "S(-1)"}}
    gathered = tmp_path / "gathered.json"
    gathered.write_text(json.dumps(plan))
    explained, sizing = _llama_sizing(gathered, tmp_path)
    assert "exchanged: one all-gather of an int64 per rank" in explained
    assert "gathers that exchange their shard sizes first" in sizing and "counted above: all_gather of x at model.layers.*.mlp" in sizing


def test_the_fast_modules_import_without_torch_and_transformers(tmp_path: Path) -> None:
    """``python -m pytest -m fast`` is the generator-only subset: none of its modules needs the runtime."""
    from tests.conftest import fast_modules

    modules = fast_modules()
    assert "tests.generator.test_golden" in modules
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    imports = "; ".join(f"import {name}" for name in modules)
    done = subprocess.run([sys.executable, "-c", imports], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in modules:  # and none of them starts a process
        text = (ROOT / f"{name.replace('.', '/')}.py").read_text()
        assert not any(word in text for word in ("subprocess", "run_distributed", "multiprocessing")), name
