"""Per-channel state leaves of a state-space mixer: a recurrence that holds its own gates (RG-LRU).

To the dataflow (:mod:`hpgen.planner.flow`) a module of the modeling file holding
parameters and no children is one opaque layer (a norm, an experts module). Inside a
state-space mixer (:mod:`hpgen.planner.derive.channels.state_space`) such a module is *opened*: its
``forward`` is interpreted on its own (:meth:`~hpgen.planner.derive.derive_context.DeriveContext.leaf_flow`), so its direct
parameter reads, reshapes and allocations are seen, and it is accepted as working on
this rank's channels only when its code shows, for ``C`` channels:

- every parameter holds one value per channel (``[C, ...]``) or per head of ``C // H``
  channels (``[H, C // H, ...]``), and no other dim of it is ``C`` (a ``[C, C]`` matrix
  would mix the channels);
- a per-head parameter is applied to heads cut head-major from the channels: the code
  reshapes its input to ``(..., H, C // H)``, so a contiguous shard of the channels is a
  shard of whole heads (``H`` must be read from an attribute, which is divided on install);
- its code (its own methods, and the functions and ``autograd.Function`` classes of the
  file it calls) calls no reduction (``sum``, ``mean``, ``softmax``, a norm...), and every
  contraction (``matmul``, ``bmm``, ``baddbmm``, ``einsum``, ``@``) takes a per-head
  parameter as an operand: it contracts within a head. This reads the source, every branch
  of it, not the one path the instance takes: conservative by design.

Only the mixer's own children are candidates, and only where every parameter they hold is
per channel or per head (:func:`follows_channels`): an attention with a parameterised helper
(a relative-position table) is not taken for a state-space mixer.

Anything else is a reason (:class:`~hpgen.planner.derive.placed.Refused`), never a guess.
"""

from __future__ import annotations

import ast
import inspect
from functools import lru_cache
from pathlib import Path
from typing import Any

from hpgen.planner.derive.column_layouts import flat_dims
from hpgen.planner.derive.derive_context import DeriveContext
from hpgen.planner.derive.placed import Refused
from hpgen.planner.flow import Flow, leaf_kind
from hpgen.planner.flow.runner import class_nodes, forward_owner, function_def, is_norm
from hpgen.planner.model.modules import relative

__all__ = ["channel_groups", "check_state_leaf", "follows_channels", "state_leaves"]

REDUCTIONS = frozenset(
    {
        "sum", "mean", "prod", "amax", "amin", "max", "min", "logsumexp", "softmax", "log_softmax", "norm",
        "var", "std", "var_mean", "std_mean", "layer_norm", "group_norm", "rms_norm", "normalize", "topk", "sort",
    }
)  # fmt: skip
CONTRACTIONS = frozenset({"matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum", "tensordot", "linear"})


def state_leaves(model: Any, fqn: str, source: Path | tuple[Path, ...]) -> list[str]:
    """The children of the mixer at ``fqn`` that the dataflow treats as leaves but whose ``forward``
    is in the modeling file, with parameters of their own and no children (not a norm)."""
    module = model.get_submodule(fqn)
    found = []
    for name, child in module.named_children():
        if leaf_kind(child, source) != "leaf" or is_norm(child) or any(True for _ in child.children()):
            continue
        owner = forward_owner(type(child), "forward")
        if not any(True for _ in child.parameters(recurse=False)) or owner is None or not _in_file(owner, source):
            continue
        found.append(f"{fqn}.{name}")
    return found


def check_state_leaf(ctx: DeriveContext, fqn: str, channels: int, mixer: str) -> set[int]:
    """The head counts of the leaf's per-head parameters, once its code shows it works per channel / per
    head (see the module docstring); raises :class:`Refused` saying what does not."""
    module = ctx.modules[fqn]
    where = relative(fqn, mixer)
    heads: set[int] = set()
    per_head: set[str] = set()
    for name, param in module.named_parameters(recurse=False):
        count = channel_groups(param, channels)
        if count is None:
            raise Refused(
                f"{where}.{name} {tuple(param.shape)} neither holds one value per channel nor per head of the "
                f"{channels} channels"
            )
        if count < channels:
            heads.add(count)
            per_head.add(name)
    flow = ctx.leaf_flow(fqn)
    first = flow.first_input
    for count in sorted(heads):
        if not _cuts_heads(flow, f"in:{first}", count, channels // count, fqn):
            raise Refused(
                f"{where} holds parameters of {count} heads but its forward does not reshape its {channels} channels "
                f"head-major into ({count}, {channels // count}) with a head count read from an attribute"
            )
    found = _code_problem(type(module), per_head)
    if found is not None:
        raise Refused(f"{where} {found}, which could combine the channels")
    return heads


def follows_channels(module: Any, channels: int) -> bool:
    """Whether every parameter of ``module`` holds one value per channel or per head (see the module docstring)."""
    params = list(module.parameters(recurse=False))
    return bool(params) and all(channel_groups(p, channels) is not None for p in params)


def channel_groups(param: Any, channels: int) -> int | None:
    """``C`` for a ``[C, ...]`` parameter, ``H`` for ``[H, C // H, ...]``, None otherwise (or when another
    dim is ``C``: a matrix over the channels mixes them)."""
    shape = tuple(int(s) for s in param.shape)
    if shape and shape[0] == channels and channels not in shape[1:]:
        return channels
    if len(shape) >= 2 and 1 < shape[0] < channels and channels % shape[0] == 0:
        if shape[1] == channels // shape[0] and channels not in shape[2:]:
            return shape[0]
    return None


def _cuts_heads(flow: Flow, origin: str, count: int, width: int, fqn: str) -> bool:
    """Whether a reshape of ``origin`` has the dims ``(count, width)`` side by side, ``count`` an attribute read."""
    for use in flow.shapes:
        if use.method not in ("view", "reshape", "unflatten") or origin not in use.receiver:
            continue
        values = list(use.arg_vals[1:] if use.method == "unflatten" else use.arg_vals)
        if len(values) == 1 and values[0].items is not None:
            values = list(values[0].items)
        dims = flat_dims(values)
        for i in range(len(dims) - 1):
            if dims[i] == count and dims[i + 1] == width and any(m == fqn for m, _ in values[i].all_reads()):
                return True
    return False


def _code_problem(cls: type, per_head: set[str]) -> str | None:
    """What in the leaf's code could mix channels: a reduction, or a contraction without a per-head weight."""
    path = inspect.getsourcefile(cls)
    if path is None:
        return "has no Python source"
    nodes = class_nodes(path)
    pending: list[ast.AST] = [f for f in [function_def(cls, "forward")] if f is not None]
    seen: set[int] = set()
    while pending:
        function = pending.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        for node in ast.walk(function):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                if not ({_self_param(node.left), _self_param(node.right)} & per_head):
                    return f"multiplies matrices at line {node.lineno} without a per-head weight"
            if not isinstance(node, ast.Call):
                continue
            name = _called(node.func)
            if name in REDUCTIONS:
                return f"calls {name} at line {node.lineno}"
            if name in CONTRACTIONS and not ({_self_param(a) for a in node.args} & per_head):
                return f"calls {name} at line {node.lineno} without a per-head weight"
            pending.extend(_followed(cls, node.func, nodes))
    return None


def _called(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _self_param(node: ast.expr) -> str | None:
    """``self.w`` (or ``self.w[...]``) -> ``w``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _followed(cls: type, func: ast.expr, nodes: dict[str, tuple[ast.ClassDef, ...]]) -> list[ast.AST]:
    """The code a call runs that is the file's own: ``self.method(...)``, a function of the file, or
    ``Name.apply(...)`` of an ``autograd.Function`` class of the file (its forward and backward)."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        method = function_def(cls, func.attr)
        return [method] if method is not None else []
    if isinstance(func, ast.Attribute) and func.attr == "apply" and isinstance(func.value, ast.Name):
        return [s for c in nodes.get(func.value.id, ()) for s in c.body if isinstance(s, ast.FunctionDef)]
    if isinstance(func, ast.Name):
        return list(_module_functions(inspect.getsourcefile(cls) or "").get(func.id, ()))
    return []


@lru_cache(maxsize=16)
def _module_functions(path: str) -> dict[str, tuple[ast.FunctionDef, ...]]:
    if not path:
        return {}
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    return {n.name: (n,) for n in tree.body if isinstance(n, ast.FunctionDef)}


def _in_file(cls: type, source: Path | tuple[Path, ...]) -> bool:
    from hpgen.planner.model.load import defined_in

    sources = source if isinstance(source, tuple) else (source,)
    return any(defined_in(cls, path) for path in sources)
