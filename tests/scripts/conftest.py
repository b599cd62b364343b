"""README's walk-through, run once a session: checked by tests/scripts/test_examples.py, and the folder the docs'
pages start from in tests/scripts/test_doc_blocks.py (it ran the same commands a second time before)."""

from __future__ import annotations

import pytest

from tests.support.walk_through import WalkThrough, run_walk_through


@pytest.fixture(scope="session")
def readme_walk_through(tmp_path_factory: pytest.TempPathFactory) -> WalkThrough:
    """README's files and command block, verbatim (:func:`tests.support.walk_through.run_walk_through`)."""
    return run_walk_through(tmp_path_factory.mktemp("readme"), tmp_path_factory.mktemp("bin") / "bin")
