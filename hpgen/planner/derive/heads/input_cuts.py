"""Per-head inputs of an attention made outside it (ALiBi): how the derivation cuts them.

BLOOM passes its attention ``alibi``, MPT ``position_bias``: one slice per head for all
heads. Under head sharding each rank needs its own heads' slices. Where the head dim is a
dim of its own the attention's block takes the input ``R -> S(d)``; where the heads are
fused into the batch dim (``[batch * heads, ...]``) a region's local compute cuts it
(:mod:`hpgen.runtime.forward.local_heads`); an argument with no head dim (ProphetNet's position
buckets) is not per head and stays replicated. The head dim comes from a meta-device
forward (:mod:`hpgen.planner.derive.heads.input_dims`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from hpgen.core.placement import shard
from hpgen.planner.derive.heads.rules import HeadRules, per_head_input
from hpgen.planner.derive.placed import BATCH_MAJOR, HeadCut, Placed, Refused
from hpgen.planner.derive.projection_groups import sources
from hpgen.planner.flow import Flow
from hpgen.planner.model.modules import is_linear

__all__ = ["cut_heads", "head_inputs"]


def head_inputs(rules: HeadRules, inner: Flow, common: str, rows: Iterable[str], query_heads: int) -> dict[str, HeadCut]:
    """Arguments of the attention block ``common`` (whose flow is ``inner``) that carry one slice per head
    (made outside it) -> their cut.

    ``S(d)`` where the head dim is a dim of its own; ``batch_major`` where it is fused with
    the batch; arguments without a head dim are not per head and stay replicated.
    """
    from hpgen.planner.derive.heads.input_dims import head_layouts

    inner_linears = {f for f in inner.edges if is_linear(rules.modules.get(f))}
    names = sorted(
        {
            m
            for row in rows
            for m in sources(inner, row, inner_linears, rules.per_head).markers
            if per_head_input(m) and not rules.switched_off(m)
        }
    )
    if not names:
        return {}
    listed = ", ".join(repr(n) for n in names)
    try:
        layouts = head_layouts(rules.model, {common: tuple(names)}, query_heads, recorded=rules.meta_arguments)
    except RuntimeError as error:
        raise Refused(
            f"the attention adds {listed}, made outside it, and hpgen cannot tell its head dim: {error}"
        ) from None
    found: dict[str, HeadCut] = {}
    for name in names:
        layout = layouts[(common, name)]
        if layout.kind == "dim":
            found[name] = shard(layout.dim)
        elif layout.kind == "batch_major":
            found[name] = BATCH_MAJOR
    if BATCH_MAJOR in found.values() and rules.tp is None:
        raise Refused(f"the attention adds {listed} with the heads fused into the batch dim, which needs --tp")
    return found


def cut_heads(placed: Placed, head_inputs: Mapping[str, HeadCut] | None, query_heads: int | None) -> None:
    """Record on ``placed`` (the attention's block or its ``heads`` entry) the cuts of its per-head inputs."""
    for name, placement in sorted((head_inputs or {}).items()):
        placed.head_inputs[name] = placement
        if placement == BATCH_MAJOR:
            assert query_heads is not None  # per-head inputs are found for an attention, whose heads are known
            placed.global_heads = query_heads
            placed.why += (
                f"; its per-head input {name!r} ([batch * heads, ...], made outside it) cut to this rank's "
                "heads by the region's local compute"
            )
        else:
            placed.why += f"; its per-head input {name!r} cut to this rank's heads ({placement})"
