"""The parity run shared by the runtime tests: every row of ``parity_table.PARITY`` in one spawn."""

from __future__ import annotations

import pytest

from tests.support.dist import run_distributed
from tests.support.models import Result, run_cases
from tests.support.parity_table import PARITY, lowered_cases


@pytest.fixture(scope="session")
def parity(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Result]]:
    """Per rank, each row's :class:`~tests.support.models.Result` (2 gloo ranks)."""
    cases = lowered_cases(PARITY, tmp_path_factory.mktemp("parity"))
    return run_distributed(run_cases, cases, timeout=600)
