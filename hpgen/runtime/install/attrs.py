"""Module attributes that must follow the local shards, and the check that they do.

Attention code that does not infer its local sizes from tensors (``view(..., -1,
head_dim)``) reads them from integer attributes, which ``parallelize`` divides:

- ``tp_divide_attrs`` (a list): divided by the ``tp`` axis size, e.g. ``num_heads``;
- ``divide_attrs`` (attribute -> divisor): divided by the given number. Its use is
  transformers' ``num_key_value_groups`` (query heads per key/value head, what
  ``repeat_kv`` repeats by) when the key/value projections are ``RS(0,r)``: a rank then
  holds ``H / tp`` query heads and ``kv * r / tp`` key/value heads, so its groups are
  ``H / kv / r`` and the plan says ``{"num_key_value_groups": r}`` (``hpgen plan`` writes it).

- ``local_attrs`` (attribute -> a count): the value on this rank, counted from its shards
  (:class:`hpgen.core.plan.LocalCount`), where ranks hold different numbers of heads
  (``S(d,u)``, ``B``): Falcon's ``num_heads``, ``num_key_value_groups`` as this rank's
  query rows over its key/value rows. Counted for every rank, so every rank refuses alike
  a count that does not divide or is zero (a rank with no head).

Each value must divide. Then, for every attention module whose plan entry replicates
heads (an ``RS`` projection), the query heads of every rank must be exactly the ones
that its key/value heads serve, in ``repeat_kv``'s order, with the module's
``num_key_value_groups`` after the divisions: a plan that forgets to divide it (or
replicates the wrong way) is refused, naming the module, the sizes and the axis, instead
of attending with the wrong heads. Where a ``B`` layout keeps the key/value heads whole on
every rank (multi-query Falcon), ``num_key_value_groups`` must follow the cut ``num_heads``
on every rank (``num_heads = num_key_value_groups * num_kv_heads``), or it is refused alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from torch import nn

from hpgen.core.model_config import config_value
from hpgen.core.plan import Layout, LocalCount
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.forward.collectives import AxisCollectives
from hpgen.runtime.install.module_decisions import ModuleDecision
from hpgen.runtime.install.params import Matched
from hpgen.core.shards import ShardLayout

__all__ = ["survey_attrs"]


def survey_attrs(records: Sequence[ModuleDecision], axes: Mapping[str, AxisCollectives]) -> list[tuple[nn.Module, str, int]]:
    """``(module, attribute, new value)`` for every divided attribute, all checked."""
    found = []
    for record in records:
        item, mesh = record.item, record.mesh
        where = f"{item.fqn} ({type(item.module).__name__})"
        divisors = [(attr, axes["tp"].size, "axis 'tp' of size") for attr in item.entry.tp_divide_attrs]
        divisors += [(attr, divisor, "divide_attrs divisor") for attr, divisor in item.entry.divide_attrs]
        values: dict[str, int] = {}
        local: dict[str, dict[tuple[int, ...], int]] = {}  # attribute -> its value at every mesh coordinate
        for attr, divisor, what in divisors:
            key = "tp_divide_attrs" if what.startswith("axis") else "divide_attrs"
            value = getattr(item.module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ParallelizeError(f"{where}: {key} names {attr!r}, which is not an int attribute")
            if value % divisor:
                raise ParallelizeError(
                    f"{where}: {attr}={value} does not divide over {what} {divisor}. Where ranks hold different "
                    f"numbers of heads, cut whole heads (S(d,head_dim)) and count {attr} per rank with local_attrs "
                    "(docs/plan-format.md)"
                )
            values[attr] = value // divisor
            found.append((item.module, attr, value // divisor))
        for attr, count in item.entry.local_attrs:
            value = getattr(item.module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ParallelizeError(f"{where}: local_attrs names {attr!r}, which is not an int attribute")
            local[attr] = _local_values(item, mesh, axes, attr, count, where)
            found.append((item.module, attr, local[attr][tuple(axes[a].rank for a in mesh)]))
        _check_head_groups(item, mesh, axes, values, local, where)
        _check_whole_kv_groups(item, mesh, axes, values, local, where)
    return found


def _local_values(
    item: Matched, mesh: tuple[str, ...], axes: Mapping[str, AxisCollectives], attr: str, count: LocalCount, where: str
) -> dict[tuple[int, ...], int]:
    """``count`` at every mesh coordinate, each checked (a rank refusing alone would hang the others)."""
    shapes = {}
    for name in count.params():
        try:
            shapes[name] = tuple(item.module.get_parameter(name).shape)
        except AttributeError:
            raise ParallelizeError(
                f"{where}: local_attrs.{attr} counts {name!r}, which is not a parameter of this module"
            ) from None
    sizes = [axes[a].size for a in mesh]

    def at(ranks: tuple[int, ...]) -> int:
        def shard_of(name: str) -> ShardLayout:
            layout = item.entry.params.get(name, Layout(()))
            return ShardLayout.of(shapes[name], [layout.on(a) for a in mesh], ranks, sizes)

        coordinate = _coordinate(mesh, ranks)
        try:
            value = count.value(shard_of)
        except ValueError as error:
            raise ParallelizeError(f"{where}: local_attrs.{attr} at {coordinate}: {error}") from None
        if value < 1:
            raise ParallelizeError(
                f"{where}: local_attrs.{attr} is 0 at {coordinate} ({count.describe()}): that rank would hold no "
                "head; use fewer ranks"
            )
        return value

    return {ranks: at(ranks) for ranks in itertools.product(*(range(size) for size in sizes))}


def _check_head_groups(
    item: Matched,
    mesh: tuple[str, ...],
    axes: Mapping[str, AxisCollectives],
    values: Mapping[str, int],
    local: Mapping[str, Mapping[tuple[int, ...], int]],
    where: str,
) -> None:
    """Every rank's query heads use exactly its key/value heads, grouped as ``repeat_kv`` does."""
    module = item.module
    replicating = [a for a in mesh for layout in item.entry.params.values() if layout.on(a).kind == "RS"]
    if not replicating or not hasattr(module, "num_key_value_groups"):
        return
    config = getattr(module, "config", None)
    heads = config_value(config, "num_attention_heads")
    kv_heads = config_value(config, "num_key_value_heads")
    head_dim = getattr(module, "head_dim", None)
    if not all(isinstance(n, int) and n > 0 for n in (heads, kv_heads, head_dim)):
        return
    query, keys = _projections(item, heads * head_dim, kv_heads * head_dim)
    if query is None or keys is None:
        return
    divided = values.get("num_key_value_groups", module.num_key_value_groups)
    per_kv = heads // kv_heads
    sizes = [axes[a].size for a in mesh]
    for ranks in itertools.product(*(range(size) for size in sizes)):
        q0, q1 = (n // head_dim for n in _rows(item, query, mesh, ranks, sizes))
        k0, k1 = (n // head_dim for n in _rows(item, keys, mesh, ranks, sizes))
        wanted = [q // per_kv - k0 for q in range(q0, q1)]
        groups = _count_at("num_key_value_groups", ranks, {"num_key_value_groups": divided}, local)
        got = [j // groups for j in range(q1 - q0)] if groups > 0 else []
        if k1 - k0 < 1 or wanted != got or (q1 - q0) != groups * (k1 - k0):
            coordinate = _coordinate(mesh, ranks)
            axis = replicating[0]
            raise ParallelizeError(
                f"{where}: at {coordinate} of axis {axis!r} (size {axes[axis].size}) a rank holds query heads "
                f"[{q0}, {q1}) of {heads} and key/value heads [{k0}, {k1}) of {kv_heads}, but its "
                f"num_key_value_groups would be {groups}: repeat_kv would pair them wrongly. With key/value heads "
                f"replicated as RS(0,r), divide it by r (divide_attrs: {{\"num_key_value_groups\": r}}), or, where "
                "ranks hold different numbers of query heads, count it per rank (local_attrs: the query rows per "
                "key/value row); the query heads of each rank must all belong to its key/value heads"
            )


def _check_whole_kv_groups(
    item: Matched,
    mesh: tuple[str, ...],
    axes: Mapping[str, AxisCollectives],
    values: Mapping[str, int],
    local: Mapping[str, Mapping[tuple[int, ...], int]],
    where: str,
) -> None:
    """Key/value heads kept whole on every rank by a ``B`` layout (multi-query Falcon's fused ``[queries | key |
    value]``): each rank repeats its ``num_kv_heads`` to its own query heads, so where the plan divides or counts
    ``num_heads``, ``num_key_value_groups`` must follow it (``num_heads = num_key_value_groups * num_kv_heads`` on
    every rank). transformers 5.25's Falcon reads the groups in eager attention's ``repeat_kv``; a plan that left
    them global attended with twice the key/value heads (``The size of tensor a (2) must match ... (4)``)."""
    module = item.module
    counts = [getattr(module, name, None) for name in ("num_heads", "num_kv_heads", "num_key_value_groups")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts):
        return
    heads, kv_heads, groups = counts
    if "num_heads" not in values and "num_heads" not in local:
        return  # the query heads are not cut per rank here
    if "num_kv_heads" in values or "num_kv_heads" in local:
        return  # the key/value heads are cut too: the grouped layouts (and _check_head_groups) hold them
    if not any(p.kind == "B" for layout in item.entry.params.values() for _, p in layout.placements):
        return
    for ranks in itertools.product(*(range(axes[a].size) for a in mesh)):
        held = _count_at("num_heads", ranks, values, local)
        repeat = _count_at("num_key_value_groups", ranks, {"num_key_value_groups": groups, **values}, local)
        if held != repeat * kv_heads:
            coordinate = _coordinate(mesh, ranks)
            raise ParallelizeError(
                f"{where}: at {coordinate} a rank holds {held} of {heads} query heads and all {kv_heads} key/value "
                f"head(s), but its num_key_value_groups would be {repeat}: repeat_kv would make {repeat * kv_heads} "
                "key/value heads. Divide num_key_value_groups with num_heads (tp_divide_attrs), or count it per rank "
                "like num_heads (local_attrs)"
            )


def _projections(item: Matched, query_rows: int, kv_rows: int) -> tuple[str | None, str | None]:
    """The planned ``nn.Linear`` weights whose rows (output features, sharded) hold the query
    heads and the key/value heads; a row-parallel ``o_proj`` of the same shape is not one."""
    query = keys = None
    for name in sorted(item.entry.params):
        owner_path, _, leaf = name.rpartition(".")
        owner = item.module.get_submodule(owner_path) if owner_path else item.module
        placements = [p for _, p in item.entry.params[name].placements]
        if leaf != "weight" or not isinstance(owner, nn.Linear):
            continue
        if not any(p.kind in ("S", "RS") and p.dim in (0, -2) for p in placements):
            continue
        rows = owner.weight.shape[0]
        if rows == query_rows and query is None and not any(p.kind == "RS" for p in placements):
            query = name
        elif rows == kv_rows and keys is None and any(p.kind == "RS" for p in placements):
            keys = name
    return query, keys


def _rows(item: Matched, name: str, mesh: tuple[str, ...], ranks: tuple[int, ...], sizes: list[int]) -> tuple[int, int]:
    layout = item.entry.params[name]
    shape = item.module.get_parameter(name).shape
    return ShardLayout.of(shape, [layout.on(a) for a in mesh], ranks, sizes).range(0)


def _count_at(
    attr: str, ranks: tuple[int, ...], values: Mapping[str, int], local: Mapping[str, Mapping[tuple[int, ...], int]]
) -> int:
    """``attr`` at the mesh coordinate ``ranks``: its per-rank count (``local_attrs``) where the plan gives one,
    else its one value for every rank (divided, or as the module has it)."""
    return local[attr][ranks] if attr in local else values[attr]


def _coordinate(mesh: Sequence[str], ranks: tuple[int, ...]) -> str:
    """``tp=0, cp=1``: a mesh coordinate as the refusals name it."""
    return ", ".join(f"{a}={r}" for a, r in zip(mesh, ranks))
