"""Columns that read another column's output whole and write one value per head: gathered on entry.

Doge's attention builds its dynamic mask from the values: ``dt_proj``
(``kv_heads * head_dim -> kv_heads``) reads every value head and writes one value per
key/value head, which ``A`` scales into one mask row per head. With the value heads
sharded, such a projection is still column-parallel over its outputs (``S(0)`` on its
weight and bias): its ``nn.Linear`` gathers the sharded value to the full width on entry
(an all-gather, whose backward reduce-scatters the gradient every rank computes for the
whole value), and each rank computes exactly its own heads' outputs, next to its own
heads' scores. The rule holds for any projection between the columns and the row that
reads one plain column's features whole (its input width is that column's output width)
and writes one value per query or key/value head.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from hpgen.planner.derive.column_layouts import PLAIN, ColumnLayout
from hpgen.planner.derive.heads.counts import Heads
from hpgen.planner.derive.placed import Contradicted
from hpgen.planner.derive.projection_groups import sources
from hpgen.planner.derive.split_rows import reshapes_weight
from hpgen.planner.flow import Flow
from hpgen.planner.model.modules import in_features, is_nn_linear, out_features, relative

__all__ = ["check_gathered", "gathered_columns"]


def gathered_columns(
    flow: Flow,
    cols: AbstractSet[str],
    linears: set[str],
    modules: Mapping[str, Any],
    per_head: Callable[[str], bool],
    main: str | None,
) -> dict[str, set[str]]:
    """Columns of a group fed only by other columns' outputs whole -> the columns they read.

    A candidate is an ``nn.Linear`` (the wrapper gathers its input) whose every linear
    origin is a column of the group with as many outputs as it has inputs, and which reads
    neither the residual stream nor a layer that stops the walk (a full-width norm). Whether
    it writes one value per head is checked with the heads (:func:`check_gathered`).
    """
    found: dict[str, set[str]] = {}
    for col in sorted(cols):
        module = modules[col]
        if not is_nn_linear(module) or reshapes_weight(module):
            continue
        src = sources(flow, col, linears, per_head)
        fed = src.linears
        if not fed or not fed <= cols - {col} or (main is not None and main in src.markers) or src.stops or src.raw:
            continue
        if any(out_features(modules[o]) != in_features(module) for o in fed):
            continue
        found[col] = set(fed)
    # a gathered column read by another one would be gathered twice: no such chains
    return {col: fed for col, fed in found.items() if not fed & set(found)}


def check_gathered(
    gathered: Mapping[str, set[str]],
    modules: Mapping[str, Any],
    layouts: Mapping[str, ColumnLayout],
    heads: Heads | None,
    tp: int | None,
    layer: str,
) -> None:
    """Refuse a gathered column that does not write one value per head of a plain head layout.

    The gather concatenates the ranks' contiguous shards in rank order, which is the
    column's feature order only for a plain layout (``S``); and the projection's ``S(0)``
    outputs line up with this rank's heads only when it writes one value per head.
    """
    for col, fed in sorted(gathered.items()):
        n = out_features(modules[col])
        name = relative(col, layer)
        reads = ", ".join(relative(f, layer) for f in sorted(fed))
        if heads is None or n not in (heads.query, heads.kv):
            raise Contradicted(
                f"{name} reads the output of {reads} whole and writes {n} values, not one per head: "
                "it needs the sharded value whole",
                col,
            )
        packed = sorted(f for f in fed if layouts.get(f) != PLAIN)
        if packed:
            raise Contradicted(
                f"{name} reads the output of {relative(packed[0], layer)} whole, whose packed layout a gather of "
                "its shards does not put back in order",
                col,
            )
        if tp is not None and n % tp:
            raise Contradicted(
                f"{name} writes one value for each of {n} heads, which do not divide over --tp {tp}", col
            )
