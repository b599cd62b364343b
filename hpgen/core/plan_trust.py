"""Which functions a plan may make hpgen import: a plan is data, as a checkpoint is.

An injection names its local compute function (and inner wrapper) by dotted path, and
installing the plan imports that module and calls the function with the plan's keywords.
Like transformers' ``trust_remote_code``, a plan may name hpgen's own local compute
functions freely and anything else only when the user says so: ``trust_plan_code=True``
(``--trust-plan-code``), or the module listed in ``trusted_modules`` (``--trust-module``).
:func:`untrusted_target` answers before anything is imported.
"""

from __future__ import annotations

from collections.abc import Iterable

from hpgen.core.plan_entries import FunctionRef, Plan
from hpgen.core.plan_targets import PLAN_MODULES, import_path

__all__ = ["HPGEN_COMPUTE_MODULES", "trusted_module_names", "untrusted_target"]

# hpgen's modules of local compute functions and wrappers, meant to be named by plans
# (where they live; a plan may name them by the module names of PLAN_MODULES)
HPGEN_COMPUTE_MODULES = frozenset(PLAN_MODULES.values())


def trusted_module_names(trusted_modules: str | Iterable[str]) -> tuple[str, ...]:
    """``trusted_modules`` as a tuple of module names (one name alone is taken as a list of one)."""
    names = (trusted_modules,) if isinstance(trusted_modules, str) else tuple(trusted_modules)
    for name in names:
        if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"trusted_modules: {name!r} is not a module name (a dotted path such as 'mypackage.compute')")
    return names


def _trusted(target: FunctionRef, modules: tuple[str, ...]) -> bool:
    module, _, name = import_path(target.path).rpartition(".")
    if module in HPGEN_COMPUTE_MODULES and not name.startswith("_"):
        return True
    return any(module == listed or module.startswith(listed + ".") for listed in modules)


def untrusted_target(
    plan: Plan, *, trust_plan_code: bool = False, trusted_modules: str | Iterable[str] = ()
) -> str | None:
    """One line naming the first function ``plan`` would import that the user has not trusted, or ``None``.

    ``trusted_modules`` trusts each listed module and the modules under it (``mypackage``
    trusts ``mypackage.compute.scaled``)."""
    if trust_plan_code:
        return None
    modules = trusted_module_names(trusted_modules)
    for injection in plan.injections:
        for what, target in (("local_compute_fn", injection.local_compute_fn), ("inner_wrapper", injection.inner_wrapper)):
            if target is None or _trusted(target, modules):
                continue
            package = target.path.split(".")[0]
            where = "" if plan.name == "<plan>" else f"{plan.name}: "  # "<plan>": given as a dict
            return (
                f"{where}the injection for {injection.match!r} names the {what} {target.path!r}, which is not one "
                f"of hpgen's own local compute functions, and a plan imports other code only when you trust it: pass "
                f"trust_plan_code=True or trusted_modules=[{package!r}] (hpgen verify --trust-plan-code or "
                f"--trust-module {package})"
            )
    return None
