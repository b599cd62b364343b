"""Shared paths and helpers for the generator tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
PLANS = Path(__file__).resolve().parent / "plans"
GOLDEN = Path(__file__).resolve().parent / "golden"


def transformers_modeling_file(model: str) -> Path:
    """The installed transformers' modeling_<model>.py, read from site-packages."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        pytest.fail("transformers is a test dependency: pip install -e '.[test]'")
    return Path(spec.origin).parent / "models" / model / f"modeling_{model}.py"


@pytest.fixture
def tiny_source() -> str:
    return (FIXTURES / "modeling_tiny.py").read_text()


# The generator-only test modules: they import neither torch nor transformers and start no
# process, so ``python -m pytest -m fast`` runs them in seconds, in an install without the
# runtime too (tests/cli/test_messages.py imports them with torch and transformers blocked).
# A new module is not fast until it is listed here.
FAST_MODULES = (
    "test_classify",
    "test_column_layouts",
    "test_docs",
    "test_golden",
    "test_hardening_injection",
    "test_hardening_writes",
    "test_index",
    "test_layers",
    "test_packaging",
    "test_placement",
    "test_plan",
    "test_shards",
    "test_source_styles",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of :data:`FAST_MODULES` ``fast``."""
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rpartition(".")[2] in FAST_MODULES:
            item.add_marker(pytest.mark.fast)
