"""Hub-function wrappers (the ``kernels`` package, which transformers 5.25 requires) follow the generated file.

A ``use_kernelized_func`` layer keeps per-instance wrappers of its file's hub functions in
``_kernel_funcs``; ``kernelize`` binds a hub kernel to them. After ``parallelize`` swaps the
instance's class for the generated one, the wrappers are the generated file's and run its
functions, never a bound kernel, and ``parallelize`` says so once.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from tests.runtime.install.test_kernel_stubs import mesh  # noqa: F401  (a one-rank gloo mesh, the same fixture)
from tests.support.derived_configs import tiny

pytest.importorskip("kernels")  # transformers' hub functions exist only with the package installed


def test_parallelize_drops_a_hub_kernel_bound_to_a_planned_layer(tmp_path: Path, mesh: object, capsys) -> None:
    from hpgen.generator.generate import infer_package
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model, model_class_for
    from hpgen.runtime import parallelize
    from tests.support.models import import_file

    config = tiny("mamba")
    plan = plan_model(meta_model(config), tp=2, from_source=True, name="mamba")
    source = Path(inspect.getsourcefile(model_class_for(config)) or "")
    path = tmp_path / "mamba_derived.py"
    path.write_text(lower(source.read_text(), plan_from_dict(plan), source_name=source.name, package=infer_package(source)))
    generated = import_file(str(path))

    model = model_class_for(config)(config)
    mixer = model.backbone.layers[0].mixer
    bound = mixer._kernel_funcs["causal_conv1d_forward"]
    bound.forward = lambda *args, **kwargs: None  # what kernelize does: a hub kernel on the instance
    parallelize(model, plan, mesh, generated=[generated])
    wrapper = mixer._kernel_funcs["causal_conv1d_forward"]
    assert type(wrapper) is type(generated.causal_conv1d_forward) and "forward" not in vars(wrapper)
    assert "causal_conv1d_forward instead of the hub kernel" in capsys.readouterr().err
