"""Which class statements of a modeling file the planner reads, and which ``hpgen lower`` rewrites.

Most files define their classes at the top level; some define them under a module-level
``if``/``try`` (xLSTM: ``if is_xlstm_available(): ... else: class xLSTMBlock ...``). The
interpreter reads both kinds; the lowering rewrites only top-level class statements, so the
derivation places blocks on those alone (:func:`top_level_class`).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

__all__ = ["module_level", "top_level_class"]


def module_level(statements: list[ast.stmt]) -> Iterable[ast.stmt]:
    """The statements that run at module level: the top-level ones and those inside ``if``/``try`` blocks."""
    for statement in statements:
        yield statement
        if isinstance(statement, ast.If):
            yield from module_level(statement.body)
            yield from module_level(statement.orelse)
        elif isinstance(statement, ast.Try):
            for block in (statement.body, *(h.body for h in statement.handlers), statement.orelse, statement.finalbody):
                yield from module_level(block)


def top_level_class(cls: type) -> bool:
    """Whether ``cls`` is a class statement at the top level of its file (the classes ``hpgen lower`` rewrites)."""
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return False
    if path is None:
        return False
    return cls.__qualname__ in _top_level_names(path)


@lru_cache(maxsize=64)
def _top_level_names(path: str) -> frozenset[str]:
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    return frozenset(node.name for node in tree.body if isinstance(node, ast.ClassDef))
