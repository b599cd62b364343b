"""Refuse a parallelized module whose forward would hand its shards to a fused kernel past the collectives.

transformers' Mamba files define kernel stubs (``mamba_inner_fn``,
``mamba2_split_conv1d_scan_combined``) whose torch fallback returns ``None``: the forward
then runs its torch path, the one the plan shards (``hpgen plan`` derives the plan from
that path, :mod:`hpgen.core.stubs`). Where a package is installed (``mamba_ssm``),
the name is bound to its fused kernel instead, which in training computes the whole mixer
from the raw weights, this rank's shards, without the plan's collectives: partial sums
never reduced (Mamba's ``x_proj``), or shapes that do not fit. ``parallelize`` refuses
that before touching anything, naming the function and the module.
"""

from __future__ import annotations

import ast
import inspect
import sys
from functools import lru_cache
from typing import Any

from hpgen.core.stubs import runs_stub, stub_lines

__all__ = ["refuse_replaced_stubs", "replaced_stub_problem"]


def replaced_stub_problem(module: Any) -> str | None:
    """Why ``module``'s forward would call a stub of its file that now runs a kernel, or ``None``."""
    cls = type(module)
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return None
    if path is None or not stub_lines(path):
        return None
    namespace = sys.modules.get(cls.__module__)
    for name in sorted(_called_names(cls) & set(stub_lines(path))):
        live = getattr(namespace, name, None)
        if runs_stub(live, path, name):
            continue
        return (
            f"its forward calls {name}, which the modeling file defines as a stub returning None (so that the torch "
            "path the plan shards runs), but an installed package has bound it to a fused kernel that would compute "
            "with this rank's shards past the plan's collectives. Run without that package (mamba_ssm) or set "
            f"{cls.__module__}.{name} back to the file's stub"
        )
    return None


@lru_cache(maxsize=256)
def _called_names(cls: type) -> frozenset[str]:
    """Plain names called in the methods of the class (its original forward included) and its bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch", "builtins")):
            continue
        try:
            tree = ast.parse(_dedented(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        names |= {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return frozenset(names)


def _dedented(text: str) -> str:
    import textwrap

    return textwrap.dedent(text)


def refuse_replaced_stubs(model: Any, matched: Any) -> None:
    """Raise :class:`ParallelizeError` for a planned module, or the module that calls it, whose forward
    would run a fused kernel instead of its file's stub (see the module docstring)."""
    from hpgen.runtime.errors import ParallelizeError

    seen: set[int] = set()
    for item in matched:
        parent = item.fqn.rpartition(".")[0]
        for fqn in (item.fqn, parent):
            try:
                module = model.get_submodule(fqn) if fqn else model
            except AttributeError:
                continue
            if id(module) in seen:
                continue
            seen.add(id(module))
            problem = replaced_stub_problem(module)
            if problem is not None:
                where = f"{fqn or 'the model'} ({type(module).__name__}), planned in param_plan[{item.key!r}]"
                raise ParallelizeError(f"{where}: {problem}")
