"""The parity run shared by the runtime tests: every row of ``parity_table.PARITY`` in one spawn."""

from __future__ import annotations

import pytest

from tests.dist import run_distributed
from tests.runtime.models import Case, Result, lower_family, run_cases
from tests.runtime.parity_table import PARITY


@pytest.fixture(scope="session")
def parity(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Result]]:
    """Per rank, each row's :class:`~tests.runtime.models.Result` (2 gloo ranks)."""
    directory = tmp_path_factory.mktemp("parity")
    files: dict[str, str] = {}
    cases = []
    for name, row in PARITY.items():
        plan = row.plan_dict()
        if row.file_of is None:
            path = lower_family(row.family, plan, directory, mode=row.mode)
            files[name] = str(path.rename(directory / f"{name}.py"))
        cases.append(Case(name, row.family, files[row.file_of or name], plan, row.config))
    return run_distributed(run_cases, cases, timeout=600)
