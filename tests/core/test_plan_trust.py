"""A plan is data: its injections may name hpgen's own local compute functions, anything else only when trusted."""

from __future__ import annotations

import pytest

from hpgen.core.plan import plan_from_dict
from hpgen.core.plan_trust import untrusted_target

ENTRY = {"params": {"weight": {"tp": "S(0)"}}}


def _plan(target: object, wrapper: object = None) -> object:
    injection = {"match": "model.layers.*.mlp", "local_compute_fn": target}
    if wrapper is not None:
        injection["inner_wrapper"] = wrapper
    return plan_from_dict(
        {"mesh_dim_names": ["tp"], "param_plan": {"model.layers.*.mlp": ENTRY}, "injections": [injection]},
        name="plan.json",
    )


@pytest.mark.parametrize(
    "target",
    [
        "hpgen.runtime.local.experts_parallel",
        {"_target_": "hpgen.runtime.local.batch_parallel", "axis": "ep"},
        "hpgen.runtime.local_heads.batch_major_heads",
        {"_target_": "hpgen.runtime.context_attention.gathered_kv_attention", "axis": "cp"},
        "hpgen.runtime.forward.local.experts_parallel",  # where the plan names lead (hpgen.core.plan_targets)
        {"_target_": "hpgen.runtime.context.attention.gathered_kv_attention", "axis": "cp"},
    ],
)
def test_hpgen_own_functions_need_no_trust(target: object) -> None:
    assert untrusted_target(_plan(target)) is None


@pytest.mark.parametrize(
    ("target", "wrapper", "named", "package"),
    [
        ("this.s", None, "'this.s'", "this"),
        ({"_target_": "os.getcwd", "x": 1}, None, "'os.getcwd'", "os"),
        ("hpgen.runtime.local.experts_parallel", {"_target_": "mypackage.tracing.record"}, "inner_wrapper 'mypackage.tracing.record'", "mypackage"),
        ("hpgen.runtime.local._private", None, "'hpgen.runtime.local._private'", "hpgen"),  # not one of its functions
        ("hpgen.runtime.forward.collectives.all_gather", None, "'hpgen.runtime.forward.collectives.all_gather'", "hpgen"),
        ("hpgen.cli.main", None, "'hpgen.cli.main'", "hpgen"),  # hpgen, but no local compute function
    ],
)
def test_anything_else_is_named_with_the_flags(target: object, wrapper: object, named: str, package: str) -> None:
    message = untrusted_target(_plan(target, wrapper))
    assert message is not None and "\n" not in message
    assert message.startswith("plan.json: the injection for 'model.layers.*.mlp'") and named in message
    assert "trust_plan_code=True" in message and "--trust-plan-code" in message
    assert f"trusted_modules=[{package!r}]" in message and f"--trust-module {package}" in message


def test_the_user_says_so() -> None:
    plan = _plan("mypackage.compute.scaled", {"_target_": "mypackage.tracing.record"})
    assert untrusted_target(plan, trust_plan_code=True) is None
    assert untrusted_target(plan, trusted_modules=["mypackage"]) is None  # the package and the modules under it
    assert untrusted_target(plan, trusted_modules="mypackage") is None  # one name alone
    assert untrusted_target(plan, trusted_modules=["mypackage.compute", "mypackage.tracing"]) is None
    assert "'mypackage.tracing.record'" in untrusted_target(plan, trusted_modules=["mypackage.compute"])
    assert untrusted_target(plan, trusted_modules=["mypack"]) is not None  # a prefix of a name is not its package
    with pytest.raises(ValueError, match="'my package' is not a module name"):
        untrusted_target(plan, trusted_modules=["my package"])
