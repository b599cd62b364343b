"""Planned parameters: found, checked, then cut to this rank's chunk in place.

:func:`survey_params` reads the plan against the model and raises
:class:`ParallelizeError` for anything that cannot work, before any tensor changes:

- a planned (or deferred, or grad-reduced) parameter that the module does not have;
- a placement the parameter cannot take (a dim it does not have, ``P`` on a parameter,
  ``SS(d,k)`` whose ``k`` does not divide the dim);
- attention heads cut in the middle: in a module with a ``head_dim``, every sharded
  projection dim (or block of a ``B`` dim) that holds whole heads must hold a number of
  heads (query or key/value) that the axis divides (``S``), that its chunks divide
  (``RS(d,r)``: ``size / r`` chunks, so the axis size is a multiple of the key/value heads
  or divides them), or be cut in units of whole heads (``S(d,u)``, ``S(d,u,g)``); a
  projection held by a sub-module that declares its own ``num_heads`` holds that many
  (:func:`hpgen.core.shards.row_heads`); attention code infers local heads with
  ``view(..., -1, head_dim)`` and would crash mid-forward or, worse, mix heads. The
  refusal says what the plan must say instead;
- a ``B`` placement sharing its dim with another axis, or a whole-unit cut that leaves a
  rank no unit (:func:`hpgen.core.shards.placement_problem`);
- experts that do not divide (a module's ``num_experts`` on a sharded dim);
- an ``nn.Linear`` whose bias does not follow its weight (a column-parallel weight with
  a replicated bias, a row-parallel bias not in ``deferred_bias_params``);
- tied parameters (one Parameter under several names, e.g. tied word embeddings) given
  different layouts: they are never silently untied;
- parameters that are already DTensors: ``fully_shard`` (or another DTensor engine) ran
  first. hpgen shards plain tensors and must run before the engines of the other axes.

:func:`shard_params` then replaces each planned Parameter by a new ``nn.Parameter``
holding a contiguous copy of the local chunk (so the full tensor can be freed), under
every name it had, which keeps tied parameters tied.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hpgen.core.conv1d import is_conv1d
from hpgen.core.errors import did_you_mean
from hpgen.core.placement import REPLICATE, Placement
from hpgen.core.plan import Entry, Layout
from hpgen.runtime.checkpoint.registrations import registrations
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.forward.collectives import AxisCollectives
from hpgen.core.shards import (
    ShardLayout,
    block_ranges,
    blocks_problem,
    chunks_and_index,
    normalize_dim,
    placement_problem,
    row_heads,
)

__all__ = ["Matched", "ParamShard", "rank_shard", "shard_params", "survey_params"]


@dataclass(frozen=True)
class Matched:
    """A module of the model and the plan entry whose key matches its FQN."""

    fqn: str
    module: nn.Module
    key: str
    entry: Entry


@dataclass
class ParamShard:
    """One planned Parameter and every place it is registered."""

    param: nn.Parameter
    names: list[str]  # every FQN it is registered under (several when tied)
    owners: list[tuple[nn.Module, str]]  # (module, attribute) for each name
    layout: Layout  # the plan's placement on each axis
    shard_layout: ShardLayout  # this rank's shard of the full parameter


def rank_shard(
    shape: Sequence[int], layout: Layout, axes: Mapping[str, AxisCollectives], names: Sequence[str]
) -> ShardLayout:
    """This rank's shard of a tensor of full ``shape`` laid out as ``layout`` on the axes ``names`` (mesh order)."""
    placements = [layout.on(axis) for axis in names]
    return ShardLayout.of(shape, placements, [axes[axis].rank for axis in names], [axes[axis].size for axis in names])


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _parameter_names(module: nn.Module) -> str:
    names = [name for name, _ in module.named_parameters()]
    return ", ".join(names) if names else "none"


def check_param_names(matched: Iterable[Matched]) -> None:
    """Every parameter the plan names (params, deferred, grad-reduced) exists on its module."""
    for item in matched:
        entry = item.entry
        named = [("params", name) for name in entry.params]
        named += [("deferred_bias_params", name) for name in entry.deferred_bias_params]
        named += [("grad_reduce_params", name) for name in entry.grad_reduce_params]
        for part, name in named:
            try:
                item.module.get_parameter(name)
            except AttributeError:
                raise ParallelizeError(
                    f"{item.fqn or '<root>'} ({type(item.module).__name__}): param_plan[{item.key!r}].{part} names "
                    f"{name!r}, which is not a parameter of this module"
                    f"{did_you_mean(name, (found for found, _ in item.module.named_parameters()))} (its parameters: "
                    f"{_parameter_names(item.module)})"
                ) from None


def survey_params(
    model: nn.Module, matched: Iterable[Matched], axes: Mapping[str, AxisCollectives], mesh: tuple[str, ...]
) -> list[ParamShard]:
    """Check every planned parameter and return what :func:`shard_params` will do (``mesh``: the plan's axes)."""
    matched = list(matched)
    check_param_names(matched)
    _check_not_dtensors(model)
    registered = {id(found.tensor): found for found in registrations(model, buffers=False)}
    by_name = {name: key for key, found in registered.items() for name in found.names}

    planned: dict[str, tuple[Layout, Matched]] = {}
    for item in matched:
        for name, layout in item.entry.params.items():
            full = _join(item.fqn, name)
            if full in planned and planned[full][0] != layout:
                raise ParallelizeError(
                    f"{full} is planned twice with different layouts: by param_plan[{planned[full][1].key!r}] "
                    f"({_layout_text(planned[full][0], mesh)}) and by param_plan[{item.key!r}] "
                    f"({_layout_text(layout, mesh)})"
                )
            planned[full] = (layout, item)

    shards: dict[int, ParamShard] = {}
    for full, (layout, item) in sorted(planned.items()):
        key = by_name[full]
        if key in shards:
            continue
        found = registered[key]
        _check_tied(full, layout, found.names, planned, mesh)
        shard_layout = rank_shard(found.tensor.shape, layout, axes, mesh)
        name = full[len(item.fqn) + 1 :] if item.fqn else full
        _check_placements(item, name, shard_layout, mesh)
        shards[key] = ParamShard(found.tensor, list(found.names), list(found.owners), layout, shard_layout)

    for item in matched:
        _check_linear_biases(item, planned, mesh)
    return list(shards.values())


def _check_not_dtensors(model: nn.Module) -> None:
    """Refuse a model whose parameters another engine has already turned into DTensors."""
    import sys

    dtensor = sys.modules.get("torch.distributed.tensor")  # nothing is a DTensor before it is imported
    if dtensor is None:
        return
    for name, param in model.named_parameters():
        if isinstance(param, dtensor.DTensor):
            raise ParallelizeError(
                f"{name} is already a DTensor ({param.placements} on mesh {param.device_mesh.mesh_dim_names}): "
                "fully_shard (or another DTensor engine) ran before parallelize. Call parallelize first, then "
                "fully_shard / DDP on the other mesh axes"
            )


def _layout_text(layout: Layout | None, mesh: tuple[str, ...]) -> str:
    if layout is None:
        return "unplanned (R)"
    return ", ".join(f"{axis} {layout.on(axis)}" for axis in mesh)


def _check_tied(
    full: str, layout: Layout, names: list[str], planned: Mapping[str, tuple[Layout, Matched]], mesh: tuple[str, ...]
) -> None:
    """Tied names must all have ``layout`` (an unplanned name counts as replicated)."""
    if len(names) < 2:
        return
    mine = tuple(layout.on(axis) for axis in mesh)
    for other in names:
        other_layout = planned.get(other, (None, None))[0]
        theirs = tuple((other_layout.on(axis) if other_layout else REPLICATE) for axis in mesh)
        if theirs != mine:
            raise ParallelizeError(
                f"{full} and {other} are one Parameter (tied, e.g. tie_word_embeddings) but the plan lays them out "
                f"differently: {_layout_text(layout, mesh)} vs {_layout_text(other_layout, mesh)}. Give both the same "
                "layout, or untie them before parallelize (hpgen never unties weights silently)"
            )


def _input_dim(owner: nn.Module, name: str, ndim: int) -> int | None:
    """The input-feature dim of a projection's weight (``nn.Linear`` [out, in]: 1; ``Conv1D`` [in, out]: 0)."""
    if not name.endswith("weight") or ndim != 2:
        return None
    if isinstance(owner, nn.Linear):
        return 1
    return 0 if is_conv1d(owner) else None


def _heads_label(module: nn.Module, heads: int) -> str:
    """``key/value heads`` or ``attention heads`` when the module's config says which, else ``heads``."""
    config = getattr(module, "config", None)
    kv = getattr(config, "num_key_value_heads", None) if config is not None else None
    q = getattr(config, "num_attention_heads", None) if config is not None else None
    if heads == kv and heads != q:
        return "key/value heads"
    if heads == q:
        return "attention heads"
    return "heads"


def _check_placements(item: Matched, name: str, shard_layout: ShardLayout, mesh: tuple[str, ...]) -> None:
    """Each axis's placement fits the parameter, splits no head and no expert group."""
    where = f"{item.fqn or '<root>'} ({type(item.module).__name__})"
    owner_path, _, _ = name.rpartition(".")
    owner = item.module.get_submodule(owner_path) if owner_path else item.module
    head_dim = getattr(item.module, "head_dim", None)
    num_experts = getattr(item.module, "num_experts", None)
    blocks = blocks_problem(len(shard_layout.shape), shard_layout.placements)
    if blocks is not None:
        raise ParallelizeError(f"{where}: {name}: {blocks}")
    # Each axis splits what the ones before it left; rank 0's chunk stands for all, so every
    # rank reaches the same verdict (a refusal on one rank only would hang the others).
    first = ShardLayout.of(shard_layout.shape, shard_layout.placements, [0] * len(mesh), shard_layout.sizes)
    for index, (axis, (placement, _, size)) in enumerate(zip(mesh, shard_layout.shares)):
        current = first.prefix(index).local_shape
        problem = placement_problem(current, placement, size)
        if problem is not None:
            raise ParallelizeError(f"{where}: {name} {placement} on axis {axis!r}: {problem}")
        if placement.kind == "B" and size > 1 and _input_dim(owner, name, len(current)) == normalize_dim(placement.dim, len(current)):
            if any(not inner.is_shard for _, inner in placement.parts):
                raise ParallelizeError(
                    f"{where}: {name} {placement} on axis {axis!r}: a replicated block of its input features would "
                    "be added to the partial sum once per rank; only the output features take replicated blocks"
                )
        if placement.kind in ("S", "RS", "B") and size > 1:
            dim = normalize_dim(placement.dim, len(current))
            n = current[dim]
            if isinstance(head_dim, int) and head_dim > 0 and isinstance(owner, nn.Linear):
                pieces = block_ranges(placement) if placement.kind == "B" else [((0, n), placement)]
                for block, ((lo, hi), inner) in enumerate(pieces):
                    label = f" block {block} ({hi - lo}:{inner})" if placement.kind == "B" else ""
                    cut = _head_cut(hi - lo, inner, size, head_dim, item, owner_path)
                    if cut is not None:
                        raise ParallelizeError(
                            f"{where}: {name} {placement} on axis {axis!r} of size {size}: dim {dim}{label} {cut}: "
                            f"a rank would hold part of a head. {_heads_advice(inner, dim, head_dim, hi - lo, size)}"
                        )
            if isinstance(num_experts, int) and len(current) == 3 and n == num_experts and n % size:
                raise ParallelizeError(
                    f"{where}: {name} dim {dim} holds {n} experts, which do not divide over axis {axis!r} "
                    f"of size {size}"
                )


def _head_cut(n: int, placement: Placement, size: int, head_dim: int, item: Matched, owner_path: str) -> str | None:
    """How ``placement`` on an axis of ``size`` would cut a head of a projection dim of ``n`` rows
    holding heads of ``head_dim`` (None where it keeps heads whole, or where the rows are not heads)."""
    if n % head_dim or placement.kind not in ("S", "RS"):
        return None
    heads = row_heads(item.module, owner_path, n, head_dim)
    held = f"holds {heads} {_heads_label(item.module, heads)} of head_dim {n // heads} ({n} rows)"
    if placement.kind == "S" and placement.whole_units:
        if placement.unit % (n // heads):
            return f"{held}, which {placement} cuts in units of {placement.unit} rows"
        return None
    chunks = chunks_and_index(placement, 0, size)[0]
    if heads % chunks == 0:
        return None
    if placement.kind == "RS":
        return f"{held}, which its {chunks} chunks do not divide"
    return f"{held}, which do not divide over it"


def _heads_advice(placement: Placement, dim: int, head_dim: int, n: int, size: int) -> str:
    """What the plan must say instead of a placement that cuts a head."""
    heads = n // head_dim
    if size % heads == 0:
        return f"Plan it RS({dim},{size // heads}): each head whole on {size // heads} ranks"
    if heads < size:
        return f"{heads} heads cannot reach every one of {size} ranks: use at most {heads} ranks, or a multiple of {heads}"
    return (
        f"Plan it S({dim},{head_dim}): whole heads, the first ranks one more (docs/plan-format.md), with the "
        "module's head-count attributes given per rank in local_attrs"
    )


def _check_linear_biases(item: Matched, planned: Mapping[str, tuple[Layout, Matched]], mesh: tuple[str, ...]) -> None:
    """An ``nn.Linear``'s bias must follow its planned weight on every axis."""
    for name in item.entry.params:
        owner_path, _, leaf = name.rpartition(".")
        if leaf != "weight":
            continue
        owner = item.module.get_submodule(owner_path) if owner_path else item.module
        if not isinstance(owner, nn.Linear) or owner.bias is None:
            continue
        weight_fqn = _join(item.fqn, name)
        bias_fqn = weight_fqn[: -len("weight")] + "bias"
        bias_layout = planned.get(bias_fqn, (None, None))[0]
        deferred = {_join(m.fqn, b) for _, m in planned.values() for b in m.entry.deferred_bias_params}
        weight_layout = planned[weight_fqn][0]
        for axis in mesh:
            w = weight_layout.on(axis)
            b = bias_layout.on(axis) if bias_layout else REPLICATE
            w_dim = normalize_dim(w.dim, 2) if w.dim is not None else None
            if w.kind in ("S", "SS", "RS", "B") and w_dim == 0:
                wanted: Placement = w.on_dim(0)
                if b.kind != w.kind or normalize_dim(b.dim, 1) != 0 or b.on_dim(0) != wanted:
                    raise ParallelizeError(
                        f"{item.fqn}: {weight_fqn} is {w} on axis {axis!r} (output features sharded) but its bias "
                        f"{bias_fqn} is {b}: plan the bias as {wanted} too"
                    )
            elif w.kind in ("S", "SS", "B") and w_dim == 1:
                if b.kind != "R" or bias_fqn not in deferred:
                    raise ParallelizeError(
                        f"{item.fqn}: {weight_fqn} is {w} on axis {axis!r} (row-parallel: the output is a partial "
                        f"sum) so its bias {bias_fqn} must be R and listed in deferred_bias_params, or it is added "
                        "once per rank"
                    )
            elif b.kind != "R":
                raise ParallelizeError(f"{item.fqn}: {bias_fqn} is {b} on axis {axis!r} but its weight is {w}")


def shard_params(shards: Iterable[ParamShard]) -> None:
    """Replace every sharded Parameter by its local chunk under all its names."""
    with torch.no_grad():
        for shard in shards:
            if not shard.shard_layout.sharded:
                continue
            old = shard.param
            local = shard.shard_layout.local_slice(old.detach()).clone(memory_format=torch.contiguous_format)
            new = nn.Parameter(local, requires_grad=old.requires_grad)
            for module, attr in shard.owners:
                conv1d = is_conv1d(module)  # asked before the swap, while nx and nf still describe the weight
                setattr(module, attr, new)
                _update_sizes(module, conv1d)


def _update_sizes(module: nn.Module, conv1d: bool) -> None:
    """Keep ``in_features``/``num_embeddings``... truthful for the local weight (``repr``, user code)."""
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    elif conv1d:  # transformers' Conv1D: weight [in, out], and forward sizes its output by nf
        module.nx, module.nf = module.weight.shape
    elif isinstance(module, nn.Embedding):
        module.num_embeddings, module.embedding_dim = module.weight.shape
