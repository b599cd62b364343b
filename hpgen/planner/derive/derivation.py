"""A Megatron-style tensor-parallel layout derived from the modeling source (no transformers plan needed).

For each decoder layer (an element of an ``nn.ModuleList`` whose class is in the modeling
file) :mod:`hpgen.planner.flow` gives the graph of its layers: which ``nn.Linear`` /
``Conv1D`` consumes which. From that graph:

1. **Groups.** A projection that writes the stream's width (the hidden size) from other
   projections' outputs alone (through the attention, an activation, a gate product, a
   per-head norm), not from the residual stream, is *row-parallel*; the projections it
   reads are its *columns*: ``o_proj`` with ``q_proj``/``k_proj``/``v_proj``, ``fc2`` with
   ``fc1``, ``c_proj`` with ``c_fc``, ``down_proj`` with ``gate_proj``/``up_proj`` (and
   an adapter's second projection added to them). A norm over the whole width, a
   convolution or any other layer on the way ends the walk: what it makes is not a shard.
2. **Checks.** Each group is sharded only when everything between its columns and rows
   works on shards: the columns' outputs reach nothing but the rows and per-head layers
   (norms, per-head scales, a relative-position map applied to each head alike);
   no norm over the full sharded width sits between them (BitNet's ``attn_sub_norm``); a
   per-head tensor made outside the module (MPT's ``position_bias``, BLOOM's ``alibi``) is cut
   to this rank's heads on entry; head counts
   divide ``--tp``; a fused projection's layout is recognised from the reshape that
   follows it (``split(split_size)`` / ``chunk(3)``: Q|K|V blocks -> ``SS(d,3)``;
   ``view(..., heads, 3, head_dim)``: per-head interleaved -> ``S(d)``; one key/value
   head packed after the queries (multi-query Falcon) -> ``B(d, ...)``, the queries cut
   and the key and value whole); heads that do not divide are cut whole, some ranks one
   more (:mod:`~hpgen.planner.derive.heads.uneven`, with the attributes that size them counted per
   rank, ``local_attrs``). Integer attributes that
   size a reshape of sharded values (``self.num_heads``, ``self.split_size``) are divided
   (``tp_divide_attrs``); a global count read from ``self.config`` there is refused. An
   attention that splits its heads into parts working together (DiffLlama's ``chunk(2)``
   pairing head ``i`` with ``i + H/2``) gets a strided cut of every part,
   ``SS(0,k)`` (:mod:`~hpgen.planner.derive.heads.parts`).
3. **Boundaries.** The group's lowest common module is one block (``R -> R`` in,
   ``P(sum) -> R`` out) when its ``forward`` returns the row's output alone (no residual
   added inside, no norm after). Otherwise the columns' common module becomes a block
   whose output stays sharded (BERT's self-attention, ``S(-1) -> S(-1)``), or each column
   ``nn.Linear`` a boundary of its own, and each row ``nn.Linear`` a row-parallel boundary
   taking the sharded input (OPT's ``fc1``/``fc2`` in the decoder layer itself).
4. Parameters the code between the projections reads itself (a per-feature scale, GPT-OSS's
   per-head ``sinks``) are sharded with them or kept replicated in the block; the
   vocabulary is placed by :mod:`hpgen.planner.derive.vocab`.

Every group or module left replicated gets a note saying why; :mod:`hpgen.planner`
writes the notes into the plan.

This module walks the decoder layers and takes each group through the steps, each a
function of a module of its own, handed what it reads (a read-only
:class:`~hpgen.planner.derive.derive_context.DeriveContext`: the model, its files, ``--tp``, the dataflows) and
the values of the step before it, and returning its own:
:func:`~hpgen.planner.derive.projection_groups.find_groups` (1: the groups, each a
:class:`~hpgen.planner.derive.projection_groups.Group`, and what lies between their projections);
:mod:`~hpgen.planner.derive.heads.rules` (a :class:`~hpgen.planner.derive.heads.rules.HeadRules` per layer);
:func:`~hpgen.planner.derive.column_decision.decide_columns` (2: the heads and each column's
:class:`~hpgen.planner.derive.column_layouts.ColumnLayout`, every override and check of it in one
place); :mod:`~hpgen.planner.derive.heads.input_cuts` (per-head inputs made outside the attention)
and :mod:`~hpgen.planner.derive.reshapes` (the attributes to divide), together a
:class:`~hpgen.planner.derive.group_blocks.GroupLayout`;
:func:`~hpgen.planner.derive.group_blocks.boundaries` (3 and 4: the boundaries and their
parameters). This module records the entries and the attributes to divide.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpgen.core.placement import REPLICATE
from hpgen.core.plan_entries import LocalCount
from hpgen.planner.derive.channels.state_space import channel_attrs, find_channel_mixer
from hpgen.planner.derive.column_decision import decide_columns
from hpgen.planner.derive.column_layouts import PLAIN
from hpgen.planner.derive.derive_context import DeriveContext
from hpgen.planner.derive.gathered import gathered_columns
from hpgen.planner.derive.group_blocks import GroupLayout, boundaries
from hpgen.planner.derive.heads.input_cuts import head_inputs
from hpgen.planner.derive.heads.rules import HeadRules, per_head_input
from hpgen.planner.derive.heads.uneven import UnevenHeads, groups_count, rank_values
from hpgen.planner.derive.latent import LatentRefused, check_broadcast, replicated_closure
from hpgen.planner.derive.placed import Contradicted, Derivation, HeadCut, Kind, NoQueryHead, Note, Placed, Refused
from hpgen.planner.derive.projection_groups import (
    Group,
    check_mid,
    depths,
    direct_params,
    find_groups,
    first_marker,
    sources,
)
from hpgen.planner.derive.reshapes import divided_attrs, sharded_counts
from hpgen.planner.derive.split_rows import place_split_rows, reshapes_weight
from hpgen.planner.derive.vocab import place_vocabulary
from hpgen.planner.flow import leaf_kind, module_names
from hpgen.planner.model.modules import attr_value, generic, is_linear, is_nn_linear, lca, positive_int, relative

__all__ = ["Derivation", "Note", "Placed", "decoder_layers", "derive"]


def derive(model: Any, *, tp: int | None, source: Path | None = None) -> Derivation:
    """The derived layout of ``model`` (normally on the meta device) for ``tp`` ranks."""
    if source is None:
        source = Path(inspect.getsourcefile(type(model)) or "")
    modules = dict(model.named_modules())
    layers, read = decoder_layers(modules, source)
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    ctx = DeriveContext(model, tp, source, read, modules, module_names(model), text_config)
    rules = HeadRules(model, modules, tp, ctx.config)  # the head rules of the model; each layer's from them
    result = Derivation()
    for layer in layers:
        _place_layer(ctx, rules, layer, result)
    place_vocabulary(model, tp=tp, source=source, names=ctx.names, result=result)
    return result


# -- decoder layers


def decoder_layers(modules: Mapping[str, Any], source: Path) -> tuple[list[str], Path | tuple[Path, ...]]:
    """The decoder layers (elements of module lists whose class is in the file, outermost first, not nested in
    another), and the files whose forwards are read: ``source``, or with the files of the layers' classes."""
    import torch.nn as nn

    found = _elements(modules, source)
    if found:
        return found, source
    # a composite model whose decoder layers are in another modeling file (Fuyu's language model
    # is a PersimmonModel): read that file's forwards too; only the lowered file's classes become
    # blocks (derived_blocks._clean), so its groups shard as wrapped leaves
    others = {
        Path(path)
        for module in modules.values()
        if isinstance(module, nn.ModuleList)
        for child in module.children()
        if (path := _source_file(type(child))) is not None and "/transformers/models/" in path
    }
    if not others:
        return found, source
    read = (source, *sorted(others))
    return _elements(modules, read), read


def _elements(modules: Mapping[str, Any], read: Path | tuple[Path, ...]) -> list[str]:
    import torch.nn as nn

    found: list[str] = []
    for fqn, module in modules.items():
        if not isinstance(module, nn.ModuleList):
            continue
        for name, child in module.named_children():
            element = f"{fqn}.{name}" if fqn else name
            if leaf_kind(child, read) != "source":
                continue
            if any(element.startswith(other + ".") for other in found):
                continue
            found.append(element)
    return found


def _place_layer(ctx: DeriveContext, model_rules: HeadRules, layer: str, result: Derivation) -> None:
    """Place the mixers and groups of one decoder layer into ``result``, and note what stays replicated."""
    flow = ctx.flow(layer)
    rules = model_rules.for_layer(flow)
    linears = {fqn for fqn in flow.edges if is_linear(ctx.modules.get(fqn))}
    linears -= _channel_mixers(ctx, layer, result)
    for group in find_groups(ctx, rules, layer, flow, linears, depths(flow)):
        cols = group.cols
        try:
            _record(result, group, *_place_group(ctx, rules, group, linears))
        except Refused as refused:
            if group.latent:  # the group with its latent projections as columns: the reason it had before
                cols = group.cols | group.latent
                plain = replace(group, cols=cols, latent=frozenset())
                try:
                    _record(result, plain, *_place_group(ctx, rules, plain, linears))
                    continue
                except Refused as plain:
                    if not isinstance(refused, LatentRefused):  # a latent's own refusal says more
                        refused = plain
            if isinstance(refused, NoQueryHead):
                result.no_query_head = result.no_query_head or str(refused)
            for fqn in sorted(cols | group.rows):
                result.note(
                    fqn, False, str(refused), needs_whole=refused.consumer if isinstance(refused, Contradicted) else ""
                )
    place_split_rows(result, ctx.modules, linears, positive_int(ctx.config("hidden_size")), layer)
    placed = set(result.placed)
    for fqn in sorted(linears):
        if not any(fqn == p or fqn.startswith(p + ".") for p in placed) and not any(
            n.target == generic(fqn) for n in result.notes
        ):
            result.note(fqn, False, "not part of a column -> row pair: kept replicated")


def _channel_mixers(ctx: DeriveContext, layer: str, result: Derivation) -> set[str]:
    """Place the state-space mixers of ``layer`` (:mod:`hpgen.planner.derive.channels.state_space`); the projections they hold."""
    taken: set[str] = set()
    hidden = positive_int(ctx.config("hidden_size"))
    for fqn in sorted(ctx.modules):
        if not (fqn == layer or fqn.startswith(layer + ".")) or any(fqn.startswith(t + ".") for t in taken):
            continue
        try:
            mixer = find_channel_mixer(ctx, fqn, layer, hidden)
            divide = channel_attrs(ctx, mixer) if mixer is not None and mixer.block is not None else {}
        except Refused as refused:
            result.note(fqn, False, str(refused))
            taken.add(fqn)
            continue
        if mixer is None:
            continue
        taken.add(fqn)
        for piece in ([mixer.block] if mixer.block is not None else []) + mixer.reduced:
            result.placed[piece.fqn] = piece
            result.note(piece.fqn, True, piece.why)
        for module, attrs in divide.items():
            owner = result.placed.get(module) or result.placed.setdefault(
                module, Placed(module, Kind.ATTRS, why="sizes of the sharded channels")
            )
            owner.divide |= attrs
    return {f for f, m in ctx.modules.items() if is_linear(m) and any(f.startswith(r + ".") for r in taken)}


# -- one group


def _place_group(
    ctx: DeriveContext, rules: HeadRules, group: Group, linears: set[str]
) -> tuple[list[Placed], Mapping[str, set[str]], Mapping[str, Mapping[str, LocalCount]]]:
    """The entries of one group, the attributes to divide and those with a value per rank (heads that do not
    divide), or :class:`Refused` saying why it stays whole."""
    modules, flow, layer = ctx.modules, group.flow, group.layer
    cols, rows, mids = group.cols, group.rows, group.mids
    attention = rules.is_attention(cols, rows)
    for fqn in sorted(cols | rows):
        if not is_linear(modules[fqn]):
            raise Refused(f"{relative(fqn, layer)} is a {type(modules[fqn]).__name__}, not a linear layer")
        if is_nn_linear(modules[fqn]) and reshapes_weight(modules[fqn]):
            raise Refused(
                f"{relative(fqn, layer)} is a {type(modules[fqn]).__name__}, whose forward reshapes its weight "
                "(a grouped projection): a slice of its rows is not a linear layer's shard"
            )
    for fqn in sorted(mids):
        check_mid(modules, rules, fqn, group)
    raw = sorted({p for row in rows for p in sources(flow, row, linears, rules.per_head).raw})
    sharded = cols | mids
    # a column reading another column's output whole (Doge's dt_proj): gathered on entry, its layout decided with the others
    gathered = gathered_columns(flow, cols, linears, modules, rules.per_head, first_marker(flow))
    for consumer, origins in flow.edges.items():
        if origins & sharded and consumer not in rows and consumer not in mids and consumer not in gathered:
            raise Contradicted(
                f"the output of {', '.join(relative(c, layer) for c in sorted(origins & cols)) or 'a column'} "
                f"also reaches {relative(consumer, layer)}, which needs it whole",
                consumer,
            )
    if flow.result.item(0).whole() & sharded:
        raise Refused("the layer returns a value computed from the sharded projections")
    if group.latent:
        closure = replicated_closure(flow, group.latent, sharded)
        check_broadcast(flow, closure, rules.head_counts(cols, rows), layer)
    side = sorted(
        {
            m
            for row in rows
            for m in sources(flow, row, linears, rules.per_head).markers
            if per_head_input(m) and not rules.switched_off(m)
        }
    )
    columns = decide_columns(ctx, rules, group, gathered, attention)  # the one owner of each column's layout
    heads, parts, layouts, replicated = columns.heads, columns.parts, columns.layouts, columns.replicated
    cut: dict[str, HeadCut] = {}
    if side and heads:
        common = lca(cols | rows)
        common = common if common == layer or common.startswith(layer + ".") else layer
        cut = head_inputs(rules, ctx.flow(common), common, rows, heads.query)
    counts = sharded_counts(modules, cols - replicated, rows, layouts, heads)
    direct = direct_params(ctx.model, modules, group, raw, layouts, heads, parts.k if parts else None)
    # reshapes of the parameters sharded with the heads (dt_bias.view(1, 1, num_heads, head_dim)) size shards too
    divide = divided_attrs(
        modules,
        flow,
        sharded | {f"param:{n}" for n, p in direct.items() if p != REPLICATE},
        counts,
        layer,
        (parts.lines if parts else set()) | columns.tokens,
    )
    for module, attrs in (parts.divide if parts else {}).items():
        divide.setdefault(module, set()).update(attrs)
    for module, attrs in _whole_kv_groups(modules, group, layouts, heads).items():
        divide.setdefault(module, set()).update(attrs)
    what = "attention" if attention else "MLP"
    ranked: dict[str, dict[str, LocalCount]] = {}
    row = PLAIN
    if columns.uneven is not None:
        ranked = _rank_attrs(modules, group, columns.uneven, direct, cut, divide)
        divide, row = {}, columns.uneven.row
    layout = GroupLayout(what, heads, parts, layouts, frozenset(gathered), direct, cut, row)
    return boundaries(ctx, rules, group, layout), divide, ranked


def _rank_attrs(
    modules: Mapping[str, Any],
    group: Group,
    uneven: UnevenHeads,
    direct: Mapping[str, Any],
    cut: Mapping[str, HeadCut],
    divide: Mapping[str, set[str]],
) -> dict[str, dict[str, LocalCount]]:
    """Heads cut unevenly: each rank's value of the attributes that would be divided (``num_heads``...), by module;
    :class:`Refused` where something else between the projections follows the heads."""
    shares, layer = uneven.shares, group.layer
    sharded = sorted(name for name, placement in direct.items() if placement != REPLICATE)
    if sharded:
        raise Refused(
            f"{relative(sharded[0], layer)} is read per head between the projections, and the {shares.heads} heads do "
            f"not divide over --tp {shares.tp}: hpgen cuts such parameters only where they divide"
        )
    if cut:
        raise Refused(
            f"the attention takes {', '.join(repr(n) for n in sorted(cut))} (one slice per head, made outside it), "
            f"which hpgen cuts only where the {shares.heads} heads divide over --tp {shares.tp}"
        )
    values = rank_values(modules, group.cols, group.rows, uneven)
    ranked: dict[str, dict[str, LocalCount]] = {}
    for module, attrs in divide.items():
        for attr in sorted(attrs):
            value = attr_value(modules, module, attr)
            count = values[value].under(module) if value in values else None
            if count is None:
                raise Refused(
                    f"self.{attr} of {relative(module, layer) or 'the layer'} sizes the sharded heads, and hpgen "
                    f"cannot tell its share on each rank where the heads do not divide over --tp {shares.tp}"
                )
            ranked.setdefault(module, {})[attr] = count
    common = lca(group.cols | group.rows)
    groups = getattr(modules.get(common), "num_key_value_groups", None)
    counted = "num_key_value_groups" in ranked.get(common, {})  # a multi-query block's, counted above
    if shares.replicas > 1 and isinstance(groups, int) and groups == shares.group and not counted:
        # what repeat_kv repeats by
        count = groups_count(values, shares, common)
        if count is None:
            raise Refused(f"hpgen cannot count {relative(common, layer) or 'the layer'}'s num_key_value_groups per rank")
        ranked.setdefault(common, {})["num_key_value_groups"] = count
    return ranked


def _whole_kv_groups(
    modules: Mapping[str, Any], group: Group, layouts: Mapping[str, Any], heads: Any
) -> dict[str, set[str]]:
    """``num_key_value_groups`` of an attention whose fused projection keeps its key/value heads whole on every rank
    (multi-query Falcon's ``[queries | key | value]``, a ``B`` layout): each rank repeats its key/value heads to its
    own query heads, so the count follows the query heads (divided, or counted per rank where they do not divide).

    transformers' attention interface reads it in ``repeat_kv`` (eager attention; sdpa may pass the heads to torch
    ungrouped, which hides a count left global); a module without the attribute has nothing to divide.
    """
    if heads is None or not any(layouts[col].in_blocks for col in group.cols if col in layouts):
        return {}
    common = lca(group.cols | group.rows)
    value = getattr(modules.get(common), "num_key_value_groups", None)
    if not isinstance(value, int) or isinstance(value, bool) or heads.kv < 1 or value != heads.query // heads.kv:
        return {}
    return {common: {"num_key_value_groups"}}


def _record(
    result: Derivation,
    group: Group,
    pieces: list[Placed],
    divide: Mapping[str, set[str]],
    ranked: Mapping[str, Mapping[str, LocalCount]],
) -> None:
    """Write one group's entries and divided attributes (and per-rank ones, ``ranked``) into ``result``
    (:class:`Refused`, and nothing written, where a module would hold two groups)."""
    for piece in pieces:
        if piece.fqn in result.placed:
            raise Refused(f"{relative(piece.fqn, group.layer) or group.layer} would hold two groups")
    for piece in pieces:
        result.placed[piece.fqn] = piece
        # a gathered leaf needs its input whole: the cross-check drops a transformers plan that shards it otherwise
        result.note(piece.fqn, True, piece.why, needs_whole=piece.fqn if piece.kind is Kind.GATHER_LEAF else "")
    for module, attrs in divide.items():
        owner = result.placed.get(module)
        if owner is None:
            owner = result.placed[module] = Placed(module, Kind.ATTRS, why="sizes of the sharded heads")
        owner.divide |= attrs
    for module, values in ranked.items():
        owner = result.placed.get(module)
        if owner is None:
            owner = result.placed[module] = Placed(module, Kind.ATTRS, why="sizes of the sharded heads")
        owner.local_attrs.update(values)


def _source_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except TypeError:
        return None
