"""Low-rank projections before the columns (multi-head latent attention): replicated, not sharded.

DeepSeek's MLA computes ``q = q_b_proj(norm(q_a_proj(x)))`` and ``kv = kv_b_proj(norm(kv_a(x)))``;
``kv_a_proj_with_mqa`` also hands one rotary key, shared by every head, straight to the
attention (``k_rot.view(b, 1, s, d).expand(-1, heads, -1, -1)``). Walking back from ``o_proj``
finds ``kv_a_proj_with_mqa`` next to ``q_b_proj``/``kv_b_proj``, but it is no column: its
output feeds another column through a norm over its whole width. Such a projection is kept
replicated inside the block (every rank computes the full latent and the shared key; its
gradient, partial per rank, is reduced), the head-sized up-projections stay the columns.

That is exact only while the replicated value enters the heads as one head broadcast to
all (``expand``), never cut into heads itself: :func:`check_broadcast` refuses a reshape of
it sized by a head count (or by ``-1``), which is what a per-head slice would need.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet

from hpgen.planner.derive.placed import Refused
from hpgen.planner.flow import Flow
from hpgen.planner.model.modules import relative

__all__ = ["LatentRefused", "check_broadcast", "fed_columns", "pre_chain", "pre_projections", "replicated_closure"]

_RESHAPES = ("view", "reshape", "unflatten")


class LatentRefused(Refused):
    """The group's latent projections cannot stay replicated next to its sharded heads."""


def _upstream(flow: Flow, start: str, linears: set[str]) -> set[str]:
    """The linears reached walking back from ``start``'s inputs through non-linear layers (norms)."""
    found: set[str] = set()
    pending = list(flow.edges.get(start, ()))
    seen: set[str] = set()
    while pending:
        origin = pending.pop()
        if origin in seen or origin.startswith(("in:", "param:")):
            continue
        seen.add(origin)
        if origin in linears:
            found.add(origin)
        elif origin in flow.edges:
            pending.extend(flow.edges[origin])
    return found


def pre_projections(flow: Flow, cols: AbstractSet[str], linears: set[str]) -> set[str]:
    """The columns that no other projection feeds and whose output feeds another column (a latent
    down-projection); an up-projection fed by a norm of a latent is a column."""
    pre: set[str] = set()
    for col in cols:
        pre |= _upstream(flow, col, linears) & cols - {col}
    return {p for p in pre if not _upstream(flow, p, linears)}


def replicated_closure(flow: Flow, pre: Iterable[str], sharded: AbstractSet[str]) -> set[str]:
    """``pre`` and the layers computed from it (and the inputs) alone: the block's replicated values."""
    found = set(pre)
    changed = True
    while changed:
        changed = False
        for leaf, origins in flow.edges.items():
            if leaf in found or leaf in sharded or not origins:
                continue
            if all(o.startswith("in:") or o in found for o in origins) and origins & found:
                found.add(leaf)
                changed = True
    return found


def check_broadcast(flow: Flow, replicated: set[str], heads: Mapping[str, int], layer: str) -> None:
    """Refuse a reshape of a replicated value into heads (``heads``: attribute name -> head count)."""
    counts = {value for value in heads.values() if value > 1}
    for use in flow.shapes:
        if use.method not in _RESHAPES or not use.receiver or not use.receiver <= replicated:
            continue
        for value in _size_args(use):
            if value.const == -1 or (isinstance(value.const, int) and value.const in counts):
                raise LatentRefused(
                    f"{relative(use.module, layer) or 'the layer'} cuts the replicated output of "
                    f"{', '.join(relative(r, layer) for r in sorted(use.receiver))} into heads (line {use.line}); "
                    "only a value shared by every head (one head, expanded) can stay replicated next to sharded heads"
                )


def _size_args(use):  # the size arguments of a reshape, a tuple argument's items included
    for value in use.arg_vals:
        if value.items is not None:
            yield from value.items
        else:
            yield value


def fed_columns(flow: Flow, cols: AbstractSet[str], group: AbstractSet[str]) -> set[str]:
    """Layers computed from the inputs (and each other) alone whose outputs reach only the columns:
    MLA's ``q_a_proj`` and ``q_a_layernorm`` before ``q_b_proj``, replicated in the block."""
    candidates: set[str] = set()
    changed = True
    while changed:
        changed = False
        for leaf, origins in flow.edges.items():
            if leaf in candidates or leaf in group or not origins:
                continue
            if all(o.startswith("in:") or o in candidates for o in origins):
                candidates.add(leaf)
                changed = True
    useful: set[str] = set()
    changed = True
    while changed:  # keep those whose every consumer is a column or another kept layer
        changed = False
        for leaf in candidates - useful:
            consumers = {c for c, o in flow.edges.items() if leaf in o}
            if consumers and consumers <= cols | useful:
                useful.add(leaf)
                changed = True
    return useful


def pre_chain(flow: Flow, start: Iterable[str], pre: AbstractSet[str]) -> set[str]:
    """The replicated layers before the columns reached from ``start``, walking back."""
    found: set[str] = set()
    pending = [o for o in start if o in pre]
    while pending:
        origin = pending.pop()
        if origin in found:
            continue
        found.add(origin)
        pending.extend(o for o in flow.inputs.get(origin, ()) if o in pre)
    return found
