"""Shared paths, and the ``fast`` marker by folder.

The tree mirrors the package (core, generator, planner, runtime/{install, forward,
checkpoint, training}, verify, cli), with package/ for the package as a whole, scripts/
for examples/ and benchmarks/, and support/ for the helpers the tests share.
"""

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


# The folders of generator-only tests: they import neither torch nor transformers and start
# no process, so ``python -m pytest -m fast`` runs them in seconds, in an install without the
# runtime too (tests/cli/test_messages.py imports them with torch and transformers blocked).
# A test is fast when its file sits directly in one of these folders (not in a subfolder:
# tests/generator/with_models/ runs what the generator writes).
FAST_FOLDERS = ("core", "generator", "package")

TESTS = Path(__file__).resolve().parent


def fast_modules() -> list[str]:
    """The dotted names of the test modules in :data:`FAST_FOLDERS`."""
    return sorted(f"tests.{folder}.{path.stem}" for folder in FAST_FOLDERS for path in (TESTS / folder).glob("test_*.py"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``fast`` the tests whose file sits directly in one of :data:`FAST_FOLDERS`."""
    for item in items:
        folder = item.path.parent
        if folder.parent == TESTS and folder.name in FAST_FOLDERS:
            item.add_marker(pytest.mark.fast)
