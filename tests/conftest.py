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
