"""The mistakes of a launch, named on every rank before ``parallelize`` changes anything.

- a plan is data: an injection naming a function outside hpgen's own is refused before the
  import (``import this`` would print the Zen of Python, ``os.getcwd`` would be called with
  the plan's keywords), unless the caller trusts it (``trust_plan_code``, ``trusted_modules``);
- a rank outside the mesh (3 processes for a 2-rank mesh);
- a plan written by ``hpgen plan --tp 4`` (14 heads) on a tp 2 mesh; a Qwen2 plan on a Llama;
- a hand plan that splits the batch at the decoder layers and leaves the rotary output, the
  mask and the positions whole.

The 2-rank scenarios share one spawn of 2 gloo ranks, the 3-rank one has its own.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.models import generated_model, import_file, load_plan_dict, lower_family, make_config, reference_model
from tests.support.untouched import snapshot, untouched

ZEN = "Beautiful is better than ugly"
MLP = "model.layers.*.mlp"


def _injected(target: object) -> dict[str, Any]:
    plan = load_plan_dict("llama_tp")
    plan["injections"] = [{"match": MLP, "local_compute_fn": target}]
    return plan


def _batch_split() -> dict[str, Any]:
    """llama_tp with the decoder layers splitting the batch over tp, their other inputs left whole."""
    plan = load_plan_dict("llama_tp")
    plan["param_plan"]["model.layers.*"] = {
        "in_src": {"hidden_states": {"tp": "R"}},
        "in_dst": {"hidden_states": {"tp": "S(0)"}},
        "out_src": {"output": {"tp": "S(0)"}},
        "out_dst": {"output": {"tp": "R"}},
    }
    del plan["param_plan"]["model.layers.*.self_attn"], plan["param_plan"]["model.layers.*.mlp"]
    return plan


def _planned_at_tp4(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``hpgen plan config.json --tp 4`` writes for a Llama of 14 heads and 2 key/value heads, and the config."""
    from click.testing import CliRunner

    from hpgen.cli import cli

    overrides = dict(num_attention_heads=14, num_key_value_heads=2, head_dim=8, hidden_size=112)
    make_config("llama", **overrides).save_pretrained(directory)
    out = directory / "plan4.json"
    done = CliRunner().invoke(cli, ["plan", str(directory / "config.json"), "--tp", "4", "-o", str(out)], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    return json.loads(out.read_text()), overrides


def _try(rank: int, world_size: int, scenarios: dict[str, tuple]) -> dict[str, tuple[str, str, list[str], bool]]:
    """Each scenario: (outcome, message, what changed in the model, whether ``os.getcwd`` was called)."""
    import contextlib
    import io
    import os
    import sys

    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.runtime import parallelize
    from hpgen.runtime.errors import ParallelizeError

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    calls = []
    getcwd = os.getcwd
    os.getcwd = lambda *args, **kwargs: calls.append((args, kwargs)) or getcwd()
    outcome = {}
    try:
        for name, (family, generated, plan, config, keywords) in scenarios.items():
            calls.clear()
            config = make_config(family, **config)
            model = generated_model(import_file(generated), family, config, reference_model(family, config, seed=0))
            before = snapshot(model)
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    parallelize(model, plan, mesh, **keywords)
            except ParallelizeError as error:
                outcome[name] = ("ParallelizeError", str(error), untouched(model, before), bool(calls))
            else:
                ids = torch.tensor([[1, 15, 7, 42, 3]])
                reference = reference_model(family, config, seed=0)
                same = torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-5)
                outcome[name] = ("parallelized", "same logits" if same else "other logits", [], bool(calls))
            assert ZEN not in printed.getvalue() and "this" not in sys.modules, name  # `import this` never ran
    finally:
        os.getcwd = getcwd
    return outcome


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, tuple], list[dict]]:
    directory = tmp_path_factory.mktemp("launch")
    llama = str(lower_family("llama", "llama_tp", directory))
    for folder in ("user", "tp4"):  # a plan given as a dict is lowered to <family>_custom_default.py
        (directory / folder).mkdir()
    user = _injected({"_target_": "tests.local_fns.scaled_mlp", "scale": 1.0})
    user_file = str(lower_family("llama", user, directory / "user"))
    tp4, heads = _planned_at_tp4(directory / "tp4")
    tp4_file = str(lower_family("llama", tp4, directory / "tp4"))
    moe = str(lower_family("qwen3_moe", "qwen3_moe_tp_ep", directory))
    getcwd = {"_target_": "os.getcwd", "path": "/"}
    scenarios = {
        # name: (family, generated file, plan, config, parallelize's keywords)
        "zen": ("llama", llama, _injected("this.s"), {}, {}),
        "getcwd": ("llama", llama, _injected(getcwd), {}, {}),
        "getcwd_other_module_trusted": ("llama", llama, _injected(getcwd), {}, {"trusted_modules": ["tests"]}),
        "user_function_untrusted": ("llama", user_file, user, {}, {}),
        "user_function_trusted_module": ("llama", user_file, user, {}, {"trusted_modules": ["tests.local_fns"]}),
        "user_function_trust_plan_code": ("llama", user_file, user, {}, {"trust_plan_code": True}),
        "hpgen_own_function": ("qwen3_moe", moe, load_plan_dict("qwen3_moe_tp_ep"), {}, {}),
        "plan_for_tp4": ("llama", tp4_file, tp4, heads, {}),
        "plan_for_qwen2": ("llama", llama, load_plan_dict("qwen2_tp"), {}, {}),
        "batch_split_alone": ("llama", llama, _batch_split(), {}, {}),
    }
    return scenarios, run_distributed(_try, scenarios, timeout=300)


def _refused(outcomes: tuple[dict, list[dict]], name: str, *parts: str) -> None:
    for rank, by_name in enumerate(outcomes[1]):
        kind, message, changes, called = by_name[name]
        assert kind == "ParallelizeError", f"rank {rank}: {kind} {message}"
        assert "\n" not in message, f"rank {rank}: not one line:\n{message}"
        for part in parts:
            assert part in message, f"rank {rank}: {part!r} not in:\n{message}"
        assert changes == [] and not called, f"rank {rank}: {changes}, os.getcwd called: {called}"


def _parallelized(outcomes: tuple[dict, list[dict]], name: str) -> None:
    for rank, by_name in enumerate(outcomes[1]):
        assert by_name[name][:2] == ("parallelized", "same logits"), f"rank {rank}: {by_name[name]}"


FLAGS = ("trust_plan_code=True", "hpgen verify --trust-plan-code")


def test_the_zen_of_python_is_not_imported(outcomes) -> None:
    _refused(outcomes, "zen", "the injection for 'model.layers.*.mlp' names the local_compute_fn 'this.s'", *FLAGS,
             "trusted_modules=['this']", "--trust-module this")  # fmt: skip


def test_os_getcwd_is_not_called(outcomes) -> None:
    _refused(outcomes, "getcwd", "'os.getcwd'", *FLAGS, "trusted_modules=['os']")
    _refused(outcomes, "getcwd_other_module_trusted", "'os.getcwd'")  # trusting tests trusts nothing of os


def test_a_users_function_runs_when_trusted(outcomes) -> None:
    _refused(outcomes, "user_function_untrusted", "'tests.local_fns.scaled_mlp'", "--trust-module tests")
    _parallelized(outcomes, "user_function_trusted_module")
    _parallelized(outcomes, "user_function_trust_plan_code")


def test_hpgen_own_functions_need_no_flag(outcomes) -> None:
    _parallelized(outcomes, "hpgen_own_function")  # hpgen.runtime.local.experts_parallel


def test_a_plan_for_another_tp_size_names_the_sizes(outcomes) -> None:
    scenarios, _ = outcomes
    assert scenarios["plan_for_tp4"][2]["planned_for"] == {"tp": 4}  # hpgen plan records the sizes
    _refused(outcomes, "plan_for_tp4", "the plan was written for tp 4 (its planned_for) and this mesh has tp 2",
             "re-plan with hpgen plan <checkpoint or config.json> --tp 2", "the first problem: ")  # fmt: skip


def test_a_plan_for_another_model_class_names_both(outcomes) -> None:
    _refused(outcomes, "plan_for_qwen2", "the plan is for Qwen2ForCausalLM (its model_class) and the model is a LlamaForCausalLM",
             "k_proj.bias")  # fmt: skip


def test_a_batch_split_without_its_companions_is_refused(outcomes) -> None:
    _refused(outcomes, "batch_split_alone", "model.layers.0: param_plan['model.layers.*'] splits the batch over 'tp'",
             "hidden_states R -> S(0)", "leaves attention_mask, position_ids, position_embeddings whole")  # fmt: skip


def _outside(rank: int, world_size: int, generated: str) -> tuple[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.runtime import parallelize
    from hpgen.runtime.errors import ParallelizeError

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))  # README's mesh, torchrun with 3 processes
    config = make_config("llama")
    model = generated_model(import_file(generated), "llama", config, reference_model("llama", config, seed=0))
    before = snapshot(model)
    try:
        parallelize(model, load_plan_dict("llama_tp"), mesh)
    except ParallelizeError as error:
        return str(error), untouched(model, before)
    return "no error", []


def test_a_rank_outside_the_mesh_is_named_on_every_rank(tmp_path: Path) -> None:
    generated = str(lower_family("llama", "llama_tp", tmp_path))  # once, before the ranks read it
    results = run_distributed(_outside, generated, world_size=3, timeout=300)
    for rank, (message, changes) in enumerate(results):
        assert message == (
            "the mesh (tp=2) holds 2 of the world's 3 ranks, so rank 2 is outside it: launch 2 processes "
            "(torchrun --nproc-per-node 2), or build the mesh over all 3 ranks"
        ), f"rank {rank}: {message}"
        assert changes == [], f"rank {rank}: {changes}"


def test_the_plan_keeps_loading_without_planned_for() -> None:
    from hpgen.core.plan import plan_from_dict

    plan = copy.deepcopy(load_plan_dict("llama_tp"))
    assert "planned_for" not in plan and plan_from_dict(plan).planned_for == {}
    assert plan_from_dict({**plan, "planned_for": {"tp": 4}}).sizes_apart({"tp": 2}) == [("tp", 4, 2)]
