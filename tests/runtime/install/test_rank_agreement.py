"""``parallelize`` refuses, on every rank, ranks that were not given the same program.

Ranks with another plan, another generated file or another hpgen version issue other
collectives: one rank computes wrong numbers while its peer dies or hangs. Each
scenario runs on 2 real gloo ranks; rank 1 gets something different, and both ranks
must raise a ``ParallelizeError`` naming rank 1 and what differs, before anything moved.
Transformers' own runtime swaps checked here too: a boundary whose ``forward`` was
replaced on the instance (what the kernels hub's ``kernelize`` does) is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_distributed
from tests.support.models import generated_model, import_file, load_plan_dict, lower_family, make_config, reference_model


def _attempt(rank: int, world_size: int, scenarios: dict[str, dict[str, Any]]) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    import hpgen.runtime.install.agreement as agreement
    from hpgen.runtime import parallelize
    from hpgen.runtime.errors import ParallelizeError

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    outcome = {}
    config = make_config("llama")
    reference = reference_model("llama", config, seed=0)
    real_version = agreement.__version__
    for name, scenario in scenarios.items():
        files, plans = scenario["files"], scenario["plans"]
        model = generated_model(import_file(files[rank % len(files)]), "llama", config, reference)
        plan = plans[rank % len(plans)]
        agreement.__version__ = scenario.get("versions", [real_version])[rank % len(scenario.get("versions", [1]))]
        if scenario.get("patch_forward") and rank == 1:
            attention = model.model.layers[0].self_attn
            attention.forward = attention._forward_impl  # what a kernel replacement does to an instance
        try:
            parallelize(model, plan, mesh)
        except ParallelizeError as error:
            outcome[name] = f"ParallelizeError: {error}"
        else:
            outcome[name] = "ok"
        finally:
            agreement.__version__ = real_version
    return outcome


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    base = tmp_path_factory.mktemp("agreement")
    tp = str(lower_family("llama", "llama_tp", base))
    # the same file name, lowered from another plan: only the header's hashes tell them apart
    (base / "other").mkdir()
    other = base / "other" / Path(tp).name
    other.write_text(lower_family("llama", "llama_tp_vocab", base / "other").read_text())
    plan, vocab = load_plan_dict("llama_tp"), load_plan_dict("llama_tp_vocab")
    scenarios = {
        "same_everywhere": {"files": [tp], "plans": [plan, str(Path(__file__).parents[2] / "plans" / "llama_tp.json")]},
        "other_plan": {"files": [tp], "plans": [plan, {**plan, "param_plan": {**plan["param_plan"], "lm_head": vocab["param_plan"]["lm_head"]}}]},
        "other_generated_file": {"files": [tp, str(other)], "plans": [plan]},
        "other_version": {"files": [tp], "plans": [plan], "versions": ["0.1.0", "9.9.9"]},
        "kernel_replaced_forward": {"files": [tp], "plans": [plan], "patch_forward": True},
    }
    return run_distributed(_attempt, scenarios, timeout=300)


def test_the_same_plan_from_a_file_and_from_a_dict_agrees(outcomes):
    assert [by_name["same_everywhere"] for by_name in outcomes] == ["ok", "ok"]


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("other_plan", ["axis 'tp'", "rank 1 vs rank 0: plan:"]),
        ("other_generated_file", ["rank 1 vs rank 0: generated file", "plan llama_tp_vocab.json", "plan llama_tp.json"]),
        ("other_version", ["rank 1 vs rank 0: hpgen version: 9.9.9 vs 0.1.0"]),
    ],
)
def test_every_rank_refuses_and_names_what_differs(outcomes, name, parts):
    for rank, by_name in enumerate(outcomes):
        message = by_name[name]
        assert message.startswith("ParallelizeError: the ranks of axis 'tp' were not given the same program"), (rank, message)
        for part in parts:
            assert part in message, (rank, part, message)


def test_a_forward_replaced_on_the_instance_is_refused_on_every_rank(outcomes):
    message = outcomes[1]["kernel_replaced_forward"]
    assert message.startswith("ParallelizeError: model.layers.0.self_attn (LlamaAttention)"), message
    assert "forward was replaced on the instance" in message and "use_kernels=False" in message
    # rank 0's model is fine, but it must not go on alone into collectives its peer never joins
    assert outcomes[0]["kernel_replaced_forward"].startswith(
        "ParallelizeError: rank 1 of axis 'tp' refused the plan, so this rank stops too: model.layers.0.self_attn"
    )
