"""A kernel stub bound to an installed package's fused kernel: refused by ``parallelize``, not planned on.

transformers' Mamba mixer calls ``mamba_inner_fn`` in training and runs its torch path
when the file's stub returns ``None``. transformers' own decorator binds the name to a
package's kernel where one is installed (``mamba_ssm``); here it is given one that exists
everywhere (``math.fsum``), which is what an installed package looks like to hpgen: the
fused call would compute with this rank's shards past the plan's collectives.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.support.derived_configs import tiny


def _kernel_bound(stub):
    """``stub`` decorated as transformers does, with a package that provides the kernel."""
    from transformers.integrations import use_kernel_func_from_hub_with_fallback

    return use_kernel_func_from_hub_with_fallback("fsum", "math")(inspect.unwrap(stub))


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[object]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_parallelize_refuses_a_stub_bound_to_a_fused_kernel(tmp_path: Path, mesh: object) -> None:
    from hpgen.generator.generate import infer_package
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.model.load import meta_model, model_class_for
    from hpgen.planner.entry.make import plan_model
    from hpgen.runtime import parallelize
    from hpgen.runtime.errors import ParallelizeError
    from tests.support.models import import_file

    config = tiny("mamba")
    plan = plan_model(meta_model(config), tp=2, from_source=True, name="mamba")
    source = Path(inspect.getsourcefile(model_class_for(config)) or "")
    path = tmp_path / "mamba_derived.py"
    text = lower(source.read_text(), plan_from_dict(plan), source_name=source.name, package=infer_package(source))
    path.write_text(text)
    generated = import_file(str(path))

    parallelize(generated.MambaForCausalLM(config), plan, mesh)  # the file's stub: the torch path runs
    generated.mamba_inner_fn = _kernel_bound(generated.mamba_inner_fn)
    with pytest.raises(ParallelizeError, match=r"backbone\.layers\.0\.mixer \(MambaMixer\).*calls mamba_inner_fn"):
        parallelize(generated.MambaForCausalLM(config), plan, mesh)


def test_the_planner_does_not_take_a_bound_kernel_for_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.mamba import modeling_mamba

    from hpgen.planner.model.load import meta_model
    from hpgen.planner.entry.make import plan_model

    monkeypatch.setattr(modeling_mamba, "mamba_inner_fn", _kernel_bound(modeling_mamba.mamba_inner_fn))
    plan = plan_model(meta_model(tiny("mamba")), tp=2, from_source=True, name="mamba")
    assert "backbone.layers.*.mixer" not in plan["param_plan"]  # the fused call may return the mixer's output
    assert "returns more than" in plan["comments"]["replicated"]["backbone.layers.*.mixer"]
