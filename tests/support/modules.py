"""Source text run as a fresh module: how the tests execute a modeling file or what hpgen generated from it."""

from __future__ import annotations

import itertools
import sys
import types

__all__ = ["load_module"]

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
