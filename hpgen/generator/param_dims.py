"""A placement's dim against the dims a parameter has, where ``__init__`` makes them plain.

``S(5)`` on a 2-D weight would only be refused by ``parallelize``, on the ranks, after the
file was generated. Where the source says how many dims a parameter has, ``hpgen lower``
(and ``explain``, ``check``) refuses it at once, naming the plan's JSON path and the
source line: a child built as ``nn.Linear(...)`` (``weight`` 2-D, ``bias`` 1-D) or
``nn.Embedding(...)`` (``weight`` 2-D), or ``self.x = nn.Parameter(torch.empty(a, b))``
and the like (:func:`hpgen.generator.init_scan._parameter_dims`). Anything else is left to the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpgen.core.errors import HpgenError
from hpgen.generator.index_records import ClassInfo, ModuleIndex
from hpgen.core.plan import Plan
from hpgen.generator.resolve import ResolvedClass, resolve_key

# Parameters of torch's modules whose dims do not depend on the arguments.
_MODULE_PARAM_DIMS = {"Linear": {"weight": 2, "bias": 1}, "Embedding": {"weight": 2}}


@dataclass(frozen=True)
class StaticDims:
    """How many dims a parameter has, and the source line that says so."""

    dims: int
    line: int  # 0 for an outside boundary (lm_head's own nn.Linear): no line in this file
    made_by: str  # ``nn.Linear`` or ``nn.Parameter(torch.empty(...))``


def check_param_dims(plan: Plan, index: ModuleIndex, resolved: dict[str, ResolvedClass], *, source_name: str) -> None:
    """Raise ``HpgenError`` for a placement naming a dim its parameter (known from the source) lacks.

    ``resolved`` holds the boundaries' classes; entries that only shard parameters are
    resolved here, and skipped where their class cannot be found (the runtime checks them).
    """
    classes = dict(resolved)
    for key, entry in plan.entries.items():
        if key not in classes and entry.params and not entry.skip_source_lowering:
            try:
                classes[key] = resolve_key(plan, index, key, source_name=source_name)
            except HpgenError:
                continue
    for key, found in sorted(classes.items()):
        if found.elsewhere:
            continue
        owner: ClassInfo | str = found.name if found.external else index.classes[found.name]
        for name, layout in sorted(plan.entries[key].params.items()):
            known = _static_dims(index, owner, name.split("."))
            if known is None:
                continue
            for axis, placement in layout.placements:
                if placement.dim is None or -known.dims <= placement.dim < known.dims:
                    continue
                where = f" at {source_name}:{known.line}" if known.line else ""
                raise HpgenError(
                    f"{placement} names dim {placement.dim}, but {name} has {known.dims} dims "
                    f"({known.made_by}{where}); a placement's dim is one of "
                    f"{', '.join(str(d) for d in range(-known.dims, known.dims))}",
                    file=plan.name,
                    where=f'param_plan["{key}"].params["{name}"].{axis}',
                )


def _static_dims(index: ModuleIndex, owner: ClassInfo | str, path: list[str], line: int = 0) -> StaticDims | None:
    """The dims of the parameter at ``path`` under ``owner`` (a class of the file, or a torch class name)."""
    if isinstance(owner, str):  # a torch module: only its own, fixed parameters
        dims = _MODULE_PARAM_DIMS.get(owner.rsplit(".", 1)[-1], {})
        if len(path) == 1 and path[0] in dims:
            return StaticDims(dims[path[0]], line, owner)
        return None
    head, rest = path[0], path[1:]
    if not rest:
        for info in index.lineage(owner):
            if head in info.param_dims:
                dims, found_line = info.param_dims[head]
                return StaticDims(dims, found_line, "nn.Parameter(torch.<factory>(...))")
        return None
    for info in index.lineage(owner):
        children = info.children.get(head)
        if not children:
            continue
        if len({(child.class_name, child.is_list) for child in children}) != 1:
            return None  # two classes: it depends
        child = children[0]
        if child.is_list:  # ``layers.0.weight``: the index names one element of the list
            if not rest[0].isdigit() or len(rest) < 2:
                return None
            rest = rest[1:]
        inner = index.class_named(child.class_name)
        return _static_dims(index, inner if inner is not None else child.class_name, rest, child.line)
    return None
