"""The parity run shared by the runtime tests: every row of ``parity_table.PARITY`` in one spawn."""

from __future__ import annotations

import pytest

from tests.dist import run_distributed
from tests.runtime.models import Result, run_cases
from tests.runtime.parity_table import PARITY, lowered_cases


@pytest.fixture(scope="session")
def parity(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Result]]:
    """Per rank, each row's :class:`~tests.runtime.models.Result` (2 gloo ranks)."""
    cases = lowered_cases(PARITY, tmp_path_factory.mktemp("parity"))
    return run_distributed(run_cases, cases, timeout=600)
