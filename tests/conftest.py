"""Shared paths, the ``fast`` marker by folder and the ``releases`` marker by file.

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


# The files CI also runs against the newest transformers 5.x it can install (``-m releases``,
# .ci/run; docs/compatibility.md says what each covers and how long it takes): one or more per
# path of the planner that reads a modeling file differently, so a release that changes such a
# file fails here before users meet it.
RELEASE_FILES = (
    "planner/test_snapshot.py",  # what the planner writes for eleven types, per release
    "planner/translate/test_translator.py",  # transformers' plans translated (Qwen3-MoE experts, --ep)
    "planner/translate/test_corrections.py",  # a plan's style corrected from the forward's dataflow
    "planner/translate/test_style_blocks.py",  # experts boundaries (identity experts)
    "planner/derive/channels/test_state_space.py",  # mamba, mamba2: derived state-space channels
    "planner/derive/test_linear_mixers.py",  # kimi_linear and other linear-attention mixers
    "planner/derive/heads/test_uneven.py",  # heads that do not divide tp, multi-query (Falcon)
    "planner/derive/heads/test_per_head_params.py",  # per-head tensors completed with the heads (inkling)
    "generator/with_models/test_transformers_lowering.py",  # lowering the installed modeling files
    "runtime/forward/test_parity.py",  # one gloo parity run per family of the parity table
    "runtime/forward/test_parity_qwen.py",  # MoE parity: tensor- and expert-parallel experts
    "runtime/forward/test_parity_derived.py",  # derived plans at parity: mamba, mamba2, kimi_linear, ...
    "runtime/install/test_kernel_stubs.py",  # kernels bound in place of a modeling file's stubs
    "runtime/install/test_hub_functions.py",  # the kernels hub's function layers
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``fast`` the tests whose file sits directly in one of :data:`FAST_FOLDERS`, ``releases`` those of
    :data:`RELEASE_FILES`."""
    for item in items:
        folder = item.path.parent
        if folder.parent == TESTS and folder.name in FAST_FOLDERS:
            item.add_marker(pytest.mark.fast)
        if item.path.relative_to(TESTS).as_posix() in RELEASE_FILES:
            item.add_marker(pytest.mark.releases)
