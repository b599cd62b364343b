"""On a mesh axis of size 1 ``parallelize`` installs everything and the ops are no-ops.

One process, a gloo group of one rank: every parameter keeps its full shape, toggle-mode
``<axis>_enable`` flags stay False, and the model computes what the unsharded one does.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hpgen.runtime import parallelize
from tests.support.models import (
    generated_model,
    import_file,
    load_plan_dict,
    lower_family,
    make_config,
    reference_model,
    tolerance,
)


@pytest.fixture
def mesh(tmp_path) -> Iterator[object]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("plan", "mode", "bias"), [("llama_bias", "toggle", True), ("llama_tp_sp", "default", False)])
def test_size_one_axis_changes_nothing(tmp_path, mesh, plan: str, mode: str, bias: bool) -> None:
    torch.set_num_threads(1)
    config = make_config("llama", attention_bias=bias, mlp_bias=bias)
    reference = reference_model("llama", config, seed=5)
    model = generated_model(import_file(lower_family("llama", plan, tmp_path, mode=mode)), "llama", config, reference)
    shapes = {name: param.shape for name, param in model.named_parameters()}
    parallelize(model, load_plan_dict(plan), mesh)

    assert {name: param.shape for name, param in model.named_parameters()} == shapes
    attention = model.model.layers[0].self_attn
    assert attention._hp_tp.size == 1
    assert getattr(attention, "tp_enable", False) is False
    ids = torch.randint(0, config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = reference(ids).logits
        assert (model(ids).logits - expected).abs().max().item() <= tolerance(expected)
