"""The names plans give hpgen's local compute functions lead to the functions, wherever the modules live."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from hpgen.core.plan_targets import PLAN_MODULES, import_path

ROOT = Path(__file__).resolve().parents[2]


def _imported(target: str) -> object:
    module, _, name = import_path(target).rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("plan_module", sorted(PLAN_MODULES))
def test_a_plan_module_name_is_no_module_and_leads_to_one(plan_module: str) -> None:
    """The old names resolve only through the table (no module is left behind at them)."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(plan_module)
    importlib.import_module(PLAN_MODULES[plan_module])


def test_other_paths_are_imported_as_written() -> None:
    assert import_path("mypackage.compute.scaled") == "mypackage.compute.scaled"
    assert import_path("hpgen.runtime.forward.local.batch_parallel") == "hpgen.runtime.forward.local.batch_parallel"
    assert import_path("hpgen.runtime.local.batch_parallel") == "hpgen.runtime.forward.local.batch_parallel"


# a ``_target_`` naming an hpgen function, in a plan file or in a plan quoted inside a snapshot's JSON line
_TARGET = re.compile(r'_target_\\?"\s*:\s*\\?"(hpgen\.[\w.]+)')


def test_every_hpgen_target_in_the_stored_plans_and_snapshots_imports() -> None:
    """Plans written before the move (tests/plans, goldens, planner snapshots) name functions that still import."""
    found: set[str] = set()
    for folder in ("tests/plans", "tests/golden", "tests/planner/snapshot"):
        for path in (ROOT / folder).rglob("*.json*"):
            found |= set(_TARGET.findall(path.read_text()))
    assert {"hpgen.runtime.local.experts_parallel", "hpgen.runtime.local_heads.batch_major_heads"} <= found
    for target in sorted(found):
        assert callable(_imported(target)), target
