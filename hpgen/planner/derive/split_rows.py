"""Row-parallel projections over a replicated input: the input is split, the output all-reduced.

Where no column -> row group shards a projection that writes the stream's width (its
columns cannot be cut into whole heads, as DeepSeek-V4's grouped output projection, or a
linear-attention mixer's gates and convolution need every feature), the projection alone
can still be row-parallel: its replicated input is split along the features on entry
(``R -> S(-1)``, no communication; the backward all-gathers the input's gradient), each
rank multiplies its slice by its rows of the weight (``S(1)``), and the partial outputs are
all-reduced (``P(sum) -> R``), its bias added once after that. That is exact for any
``nn.Linear`` called on one input, and costs the one all-reduce of its output a row-parallel
layer costs anyway. It is used where it pays: a projection whose input is wider than its
output (an output projection from the heads, ``o_b_proj`` from ``o_groups * o_lora_rank``
features), so the weight is the larger part and the all-reduce moves the narrow side.

A subclass of ``nn.Linear`` whose ``forward`` reshapes its weight (a grouped, block-diagonal
linear) is not a linear layer's shard: :func:`reshapes_weight` finds it, and the derivation
shards it neither alone nor in a group.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Mapping
from typing import Any

from hpgen.core.placement import REPLICATE, shard
from hpgen.planner.derive.placed import Derivation, Kind, Placed
from hpgen.planner.model.modules import generic, in_features, is_nn_linear, out_features

__all__ = ["place_split_rows", "reshapes_weight"]

_RESHAPES = frozenset({"view", "reshape", "unflatten", "split", "chunk", "transpose", "t"})


def reshapes_weight(module: Any) -> bool:
    """Whether ``module`` (an ``nn.Linear`` subclass) has a ``forward`` that reshapes ``self.weight``."""
    import torch.nn as nn

    forward = type(module).forward
    if forward is nn.Linear.forward:
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return True  # cannot read it: do not assume it is a plain matmul
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _RESHAPES
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "weight"
            and isinstance(node.func.value.value, ast.Name)
            and node.func.value.value.id == "self"
        ):
            return True
    return False


def place_split_rows(
    result: Derivation, modules: Mapping[str, Any], linears: set[str], width: int | None, layer: str
) -> None:
    """Make each unplaced, wide-input ``nn.Linear`` of ``layer`` writing ``width`` features a split row."""
    if not width:
        return
    placed = set(result.placed)
    for fqn in sorted(linears):
        module = modules.get(fqn)
        if not is_nn_linear(module) or reshapes_weight(module):
            continue
        if any(fqn == p or fqn.startswith(p + ".") or p.startswith(fqn + ".") for p in placed):
            continue
        if out_features(module) != width or in_features(module) <= width:
            continue
        piece = Placed(
            fqn,
            Kind.SPLIT_ROW_LEAF,
            why="row-parallel nn.Linear on its replicated input, split on entry (its columns stay replicated: "
            + _reason(result, fqn)
            + ")",
        )
        piece.params["weight"] = shard(1)
        if getattr(module, "bias", None) is not None:
            piece.params["bias"] = REPLICATE
            piece.deferred.add("bias")
        result.placed[fqn] = piece
        result.notes[:] = [n for n in result.notes if n.target != generic(fqn)]
        result.note(fqn, True, piece.why)


def _reason(result: Derivation, fqn: str) -> str:
    target = generic(fqn)
    return next((n.text for n in result.notes if n.target == target and not n.sharded), "no group")

