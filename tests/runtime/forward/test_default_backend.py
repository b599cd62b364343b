"""The runtime on a process group made with no backend, as docs/runtime.md and docs/lora.md write it.

``dist.init_process_group()`` with no backend reports ``dist.get_backend() == 'undefined'``
(torch picks gloo on a CPU-only machine), so no device can be read from the backend's name:
every exchange of the runtime takes its device from the mesh or from the group's backend
configuration. One spawn of 2 ranks on the CPU runs a tiny Llama through what exchanges
objects: ``save_pretrained`` (loaded back by transformers), the different-inputs check, and
the DoRA refusal, each failing on every rank with its own message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.models import (
    generated_model,
    generated_plan,
    import_file,
    lower_family,
    make_config,
    reference_model,
)


def _rank(rank: int, world_size: int, plan: dict[str, Any], generated: str, folder: str) -> dict[str, Any]:
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    from hpgen.runtime import parallelize

    report: dict[str, Any] = {"backend": str(dist.get_backend())}
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    config = make_config("llama")
    reference = reference_model("llama", config, seed=0)
    module = import_file(generated)
    ids = torch.tensor([[3, 17, 42, 5, 99, 8]])

    model = generated_model(module, "llama", config, reference)
    parallelize(model, plan, mesh)
    with torch.no_grad():
        report["logits"] = (model(ids).logits - reference(ids).logits).abs().max().item()
    model.save_pretrained(folder, is_main_process=rank == 0)
    dist.barrier()
    loaded = LlamaForCausalLM.from_pretrained(folder)
    expected = reference.state_dict()
    report["saved_differ"] = [n for n, t in loaded.state_dict().items() if not torch.equal(t, expected[n])]

    model = generated_model(module, "llama", config, reference)
    parallelize(model, plan, mesh)
    try:
        with torch.no_grad():
            model(input_ids=ids + rank)  # each rank its own batch
        report["inputs"] = "no error"
    except RuntimeError as error:
        report["inputs"] = str(error)

    peft_model = get_peft_model(
        generated_model(module, "llama", config, reference),
        LoraConfig(r=4, target_modules=["q_proj"], use_dora=True),
    )
    try:
        parallelize(peft_model, plan, mesh)
        report["dora"] = "no error"
    except Exception as error:  # noqa: BLE001 - the test reads which error it was
        report["dora"] = f"{type(error).__name__}: {error}"
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("default_backend")
    plan = generated_plan("llama", tp=2)
    generated = str(lower_family("llama", plan, directory))
    return run_distributed(_rank, plan, generated, str(Path(directory) / "saved"), backend=None, timeout=180)


def test_the_group_has_no_backend_name(report: list[dict[str, Any]]) -> None:
    assert [by_rank["backend"] for by_rank in report] == ["undefined", "undefined"]


def test_save_pretrained_writes_the_unsharded_checkpoint(report: list[dict[str, Any]]) -> None:
    for by_rank in report:
        assert by_rank["logits"] <= 1e-5
        assert by_rank["saved_differ"] == []


def test_different_inputs_are_named_on_every_rank(report: list[dict[str, Any]]) -> None:
    messages = [by_rank["inputs"] for by_rank in report]
    assert messages[0] == messages[1]
    assert "were given different inputs" in messages[0] and "input_ids differ" in messages[0]


def test_dora_is_refused_on_every_rank(report: list[dict[str, Any]]) -> None:
    for by_rank in report:
        assert by_rank["dora"].startswith("ParallelizeError") and "DoRA (use_dora=True)" in by_rank["dora"]
