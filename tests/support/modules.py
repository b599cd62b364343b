"""Source text run as a fresh module: how the tests execute a modeling file or what hpgen generated from it."""

from __future__ import annotations

import importlib.util
import itertools
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

__all__ = ["import_file", "load_module"]

_COUNTER = itertools.count()


def load_module(text: str, name: str | None = None) -> types.ModuleType:
    """Execute ``text`` as a new module named ``name`` (by default a fresh name, so several coexist).

    The module is in ``sys.modules`` while its body runs (dataclasses look their module up
    there), and only then; a leading byte-order mark is dropped, as Python's reader does.
    """
    module = types.ModuleType(name or f"_hpgen_test_module_{next(_COUNTER)}")
    sys.modules[module.__name__] = module
    try:
        exec(compile(text.removeprefix("\ufeff"), module.__name__, "exec", dont_inherit=True), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module


def import_file(path: Path, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Import the file ``path`` as a module named after it, as a modeling file is: ``inspect`` then finds its classes'
    source (the planner reads it), and the module leaves ``sys.modules`` when the test ends."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)
    spec.loader.exec_module(module)
    return module
