"""Two calls the dataflow follows more closely than "mixes its operands": tuple functions, in-place methods.

- A function of the module's file every ``return`` of which returns a tuple
  (``apply_rotary_pos_emb(q, k, cos, sin)`` -> ``q_embed, k_embed``) is interpreted, so that
  each item keeps its own origins: the rotated key does not depend on the query. Without it
  multi-head latent attention's shared rotary key looks computed from the query heads.
  Its own reshapes are of its locals and are not recorded.
- An in-place tensor method (``key_states[..., d:].copy_(k_rot)``, ``x.add_(y)``) makes the
  variable it writes into depend on its operands from then on.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

from hpgen.planner.flow.constants import self_path
from hpgen.planner.flow.protocols import Body
from hpgen.planner.flow.values import MAX_DEPTH, Val, union


__all__ = ["in_place", "tuple_function"]


def in_place(frame: Body, target: ast.expr, operands: list[Val]) -> None:
    """Record an in-place method on ``target``: the variable at its root now depends on ``operands``."""
    while isinstance(target, (ast.Subscript, ast.Attribute)) and not self_path(target):
        target = target.value
    if isinstance(target, ast.Name) and target.id in frame.env:
        frame.env[target.id] = union((frame.env[target.id], *operands))


def tuple_function(frame: Body, name: str, args: list[Val], kwargs: Mapping[str, Val]) -> Val | None:
    """The tuple a call of the file's function ``name`` returns, item by item; None when it is not one."""
    try:
        path = inspect.getsourcefile(type(frame.module))
    except TypeError:
        return None
    function = _module_functions(path).get(name) if path else None
    if function is None or frame.depth > MAX_DEPTH or ("", name) in frame.runner.stack:
        return None
    spec = function.args
    names = [a.arg for a in (*spec.posonlyargs, *spec.args)]
    if spec.vararg is not None or len(args) > len(names):
        return None
    env = dict(zip(names, args))
    known = set(names) | {a.arg for a in spec.kwonlyargs}
    env.update({key: value for key, value in kwargs.items() if key in known})
    if spec.kwarg is not None:
        env[spec.kwarg.arg] = union(value for key, value in kwargs.items() if key not in known)
    shapes = len(frame.runner.flow.shapes)
    frame.runner.stack.append(("", name))
    try:
        # a frame of the caller's class (statements.Frame, which imports this module)
        inner = type(frame)(frame.runner, frame.fqn, frame.module, env, frame.depth + 1)
        inner.block(function.body)
        value = inner.returned()
    finally:
        frame.runner.stack.pop()
        del frame.runner.flow.shapes[shapes:]  # its reshapes are of its own locals, not of the caller's values
    return value if value.items is not None else None


@lru_cache(maxsize=64)
def _module_functions(path: str) -> dict[str, ast.FunctionDef]:
    """Top-level functions of ``path`` every ``return`` of which returns a tuple display."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    found: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
            if returns and all(isinstance(r.value, ast.Tuple) for r in returns):
                found[node.name] = node
    return found
