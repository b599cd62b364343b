"""Channel-parallel state-space mixers (Mamba): every per-channel weight sharded with the channels.

A Mamba mixer projects the stream into ``k`` packed blocks of ``C`` channels
(``in_proj``: ``[x | z]``), runs a depthwise convolution and a selective scan on each
channel with per-channel parameters (``A_log``, ``D``, ``dt_proj``), and projects the
channels back to the stream's width (``out_proj``). Nothing but a small projection
(``x_proj``: ``dt``, ``B``, ``C`` from all the channels) mixes channels. As Megatron and
vLLM shard it, on ``--tp`` ranks:

- the stream-fed projections are column-parallel, ``SS(0,k)`` for ``k`` packed blocks
  (each rank takes its chunk of every block), ``S(0)`` for one;
- every parameter (and every layer's parameter) whose first dim is ``C`` is ``S(0)``: the
  depthwise convolution, ``A_log``, ``D``, ``dt_proj``;
- a projection reading the channels into a few values every channel needs (``x_proj``)
  is row-parallel and reduced there (``P(sum) -> R``): its own boundary, whose output's
  gradient comes back partial from the channel-sharded code after it, so it is reduced
  in backward too (``out_grad_partial``); the replicated layers between (Jamba's ``B``/``C``
  norms) get their gradients reduced;
- the projection back to the stream is row-parallel, and the mixer is one block,
  ``R -> R`` in, ``P(sum) -> R`` out.

The per-channel state may sit in a recurrence the mixer holds instead (RecurrentGemma's
RG-LRU: per-head gates ``[heads, C // heads, C // heads]``, a per-channel decay): a leaf of
the file to the dataflow, opened and checked by :mod:`hpgen.planner.derive.channels.state_leaves`. A depthwise
convolution called as a module (``self.conv_1d(x)``, not ``F.conv1d`` on its weight) gets its
``groups`` divided, and a state the mixer allocates for its channels its size attribute
(:func:`channel_attrs`).

The mixer is recognised from the graph of its own ``forward`` (:mod:`hpgen.planner.flow`)
and the shapes of its parameters, never by name: it returns the back projection's output
alone, and every parameter inside it either follows the channels or lies on the path of the
reduced values. Anything else (a norm across the channels) refuses, with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpgen.core.placement import REPLICATE, Placement, shard, strided_shard
from hpgen.planner.derive.channels.state_leaves import check_state_leaf, follows_channels, state_leaves
from hpgen.planner.derive.column_layouts import UnequalBlocks, arg_reads, flat_dims, layout_of, packed
from hpgen.planner.derive.derive_context import DeriveContext
from hpgen.planner.derive.placed import Kind, Placed, Refused
from hpgen.planner.flow import Flow, leaf_kind
from hpgen.planner.model.modules import attr_value, in_features, is_nn_linear, join, out_features, relative

__all__ = ["ChannelMixer", "channel_attrs", "find_channel_mixer"]


@dataclass
class ChannelMixer:
    """The placement of one channel-parallel mixer: its block and the reduced projections inside it."""

    fqn: str
    channels: int
    block: Placed | None  # None: the mixer's body runs replicated between a gathered and a split projection
    reduced: list[Placed] = field(default_factory=list)  # the projections that are boundaries of their own
    linears: set[str] = field(default_factory=set)  # every projection the mixer holds
    heads: set[int] = field(default_factory=set)  # head counts of per-head parameters ([heads, C // heads, ...])
    divide: dict[str, set[str]] = field(default_factory=dict)  # module FQN -> attributes sized by the channels


def find_channel_mixer(ctx: DeriveContext, fqn: str, layer: str, hidden: int | None) -> ChannelMixer | None:
    """The placement of the state-space mixer at ``fqn`` (in the decoder layer ``layer``), None when it is not one.

    A mixer is a module of the file with parameters of its own, a depthwise convolution,
    stream-fed projections and one projection back to the stream's width, whose ``forward``
    returns that projection's output alone. It is channel-parallel where every parameter
    follows the channels (see the module docstring); otherwise (a packed projection of
    unequal blocks, heads that do not divide, a norm across the channels) the honest
    fallback gathers the stream-fed projections' outputs and splits the back projection's
    input around a replicated body, and the notes say why. Raises :class:`Refused` when the
    mixer cannot be sharded at all (it returns more than the back projection's output).
    """
    modules = ctx.modules
    module = modules[fqn]
    if not hidden or leaf_kind(module, ctx.source) != "source":
        return None
    own = dict(module.named_parameters(recurse=False))
    if not own and not state_leaves(ctx.model, fqn, ctx.read):
        return None  # a mixer holds per-channel state parameters: its own (A_log, D) or a recurrence's (RG-LRU)
    if not any(_depthwise(child) for child in module.modules()):
        return None  # the mark of a state-space mixer: a convolution along the sequence, channel by channel
    flow = ctx.flow(fqn)
    linears = {f for f in flow.edges if is_nn_linear(modules.get(f)) and f.startswith(fqn + ".")}
    first = flow.first_input
    stream = f"in:{first}"
    cols = sorted(f for f in linears if stream in flow.edges[f] and in_features(modules[f]) == hidden)
    outs = [
        f
        for f in linears
        if out_features(modules[f]) == hidden and stream not in flow.edges[f] and f not in cols and flow.edges[f]
    ]
    if len(outs) != 1 or not cols:
        return None
    out = outs[0]
    channels = in_features(modules[out])
    if not own and not all(
        follows_channels(modules[leaf], channels) for leaf in state_leaves(ctx.model, fqn, ctx.read)
    ):
        return None  # its only parameterised leaves are not per-channel states: not a state-space mixer
    # from here on it is a state-space mixer: what does not fit is a reason, not a silent replica
    if flow.result.item(0).whole() != {out}:
        raise Refused(f"{relative(fqn, layer)} returns more than its back projection's output")
    if ctx.tp is not None and channels < ctx.tp:
        raise Refused(f"{channels} channels do not spread over --tp {ctx.tp}")
    where = relative(fqn, layer) or fqn
    unequal = [c for c in cols if out_features(modules[c]) % channels]
    if unequal:
        sizes = out_features(modules[unequal[0]])
        return _gathered(
            modules,
            fqn,
            channels,
            cols,
            out,
            linears,
            f"{relative(unequal[0], fqn)} packs blocks of unequal sizes ({sizes} outputs for {channels} channels), "
            "which no S or SS placement cuts per rank",
        )
    try:
        return _channel_parallel(ctx, fqn, layer, flow, channels, cols, out, linears, where)
    except Refused as refused:
        return _gathered(modules, fqn, channels, cols, out, linears, str(refused))


def _gathered(
    modules: Mapping[str, Any], fqn: str, channels: int, cols: list[str], out: str, linears: set[str], reason: str
) -> ChannelMixer:
    """The honest fallback: the stream-fed projections column-parallel with their outputs gathered, the body
    replicated (every parameter in it whole), and the back projection row-parallel from a local split."""
    mixer = ChannelMixer(fqn, channels, None, linears=set(linears))
    for col in cols:
        piece = Placed(
            col,
            Kind.COL_GATHER,
            why=f"state-space mixer: column-parallel, its output gathered for the replicated scan ({reason})",
        )
        piece.params["weight"] = shard(0)
        if modules[col].bias is not None:
            piece.params["bias"] = shard(0)
        mixer.reduced.append(piece)
    mixer.reduced.append(
        _row(out, modules[out], Kind.SPLIT_ROW, "state-space mixer: row-parallel on this rank's split of the scan's output")
    )
    return mixer


def _channel_parallel(
    ctx: DeriveContext,
    fqn: str,
    layer: str,
    flow: Flow,
    channels: int,
    cols: list[str],
    out: str,
    linears: set[str],
    where: str,
) -> ChannelMixer:
    """The Megatron layout: every per-channel weight sharded with the channels (see the module docstring)."""
    modules, tp = ctx.modules, ctx.tp
    module = modules[fqn]
    first = flow.first_input
    own = dict(module.named_parameters(recurse=False))
    leaves = state_leaves(ctx.model, fqn, ctx.read)
    for leaf in leaves:
        own.update(modules[leaf].named_parameters(prefix=relative(leaf, fqn), recurse=False))
    if not any(_heads_of(p, channels) is not None for p in own.values()):
        raise Refused(f"none of the parameters of {where} follows its {channels} channels")
    for leaf in leaves:  # a recurrence of the file holding its gates: opened, and proven to work per channel
        check_state_leaf(ctx, leaf, channels, fqn)
    why = "state-space mixer: channel-parallel projections and scan"
    if leaves:
        opened = ", ".join(relative(leaf, fqn) for leaf in leaves)
        why += f" (the recurrence {opened} read from its source: per channel and per head only)"
    block = Placed(fqn, Kind.BLOCK, inputs=(first,), why=why)
    mixer = ChannelMixer(fqn, channels, block, linears=set(linears))
    for col in cols:
        block.params[join(relative(col, fqn), "weight")] = _column_placement(ctx, flow, col, layer, channels)
        if modules[col].bias is not None:
            block.params[join(relative(col, fqn), "bias")] = block.params[join(relative(col, fqn), "weight")]
    block.params[join(relative(out, fqn), "weight")] = shard(1)
    if modules[out].bias is not None:
        block.params[join(relative(out, fqn), "bias")] = REPLICATE
        block.deferred.add(join(relative(out, fqn), "bias"))
    handled = set(cols) | {out}
    reduced = sorted(
        f for f in linears - handled if in_features(modules[f]) == channels and out_features(modules[f]) != channels
    )
    for row in reduced:
        why = "state-space mixer: row-parallel projection of the channels, reduced"
        mixer.reduced.append(_row(row, modules[row], Kind.REDUCE_LEAF, why))
        handled.add(row)
    # every other parameter follows the channels (first dim C, or heads of C // heads channels each)
    # or lies on the reduced path
    for name, param in module.named_parameters():
        owner = name.rpartition(".")[0]
        owner_fqn = join(fqn, owner) if owner else fqn
        if owner_fqn in handled:
            continue
        sub = modules[owner_fqn]
        heads = _heads_of(param, channels)
        if heads is not None and is_nn_linear(sub) and in_features(sub) == channels:
            raise Refused(f"{relative(owner_fqn, fqn)} maps the {channels} channels onto themselves: it mixes them")
        if heads is not None:
            groups = getattr(sub, "groups", None)
            if groups is not None and groups != getattr(sub, "in_channels", groups):
                raise Refused(f"{relative(owner_fqn, fqn)} is a convolution that mixes channels (groups={groups})")
            if groups is not None and owner_fqn in flow.edges:
                # called as a module (not read as F.conv1d(x, self.conv.weight, groups=x.shape[1])): nn.Conv1d
                # runs with its own groups, which must be this rank's channels
                if tp is not None and channels % tp:
                    raise Refused(
                        f"{relative(owner_fqn, fqn)} is a depthwise convolution called as a module, whose groups "
                        f"({channels}) do not divide over --tp {tp}"
                    )
                mixer.divide.setdefault(owner_fqn, set()).update(("groups", "in_channels", "out_channels"))
            if _is_norm_across(sub, owner_fqn, fqn):
                raise Refused(
                    f"{relative(owner_fqn, fqn)} ({type(sub).__name__}) normalises across the {channels} channels"
                )
            if heads < channels:
                mixer.heads.add(heads)
                if tp is not None and heads % tp:
                    raise Refused(
                        f"{name} {tuple(param.shape)} holds {heads} heads of {channels // heads} channels, which do "
                        f"not divide over --tp {tp}"
                    )
            block.params[name] = shard(0)
        elif owner_fqn != fqn and _fed_only_by(flow, owner_fqn, set(mixer_rows(mixer))):
            block.grad_reduce.add(name)  # a replicated layer on the reduced values (Jamba's B/C norms)
        else:
            raise Refused(
                f"{name} {tuple(param.shape)} of {where} neither follows its {channels} channels nor lies on "
                "the reduced values"
            )
    return mixer


def channel_attrs(ctx: DeriveContext, mixer: ChannelMixer) -> dict[str, set[str]]:
    """Module FQN -> integer attributes that size the channels (divided on install).

    The generated code runs the mixer's own body on the local channels, so a size it reads
    from ``self`` must be the local one: in a reshape or split (``self.intermediate_size``)
    of the mixer or of a recurrence it holds (the RG-LRU's ``self.num_attention_heads``),
    and in a state it allocates (``torch.zeros((batch, self.lru_width))``), a dim that is
    one attribute equal to the channel or head count. The body holds nothing of the
    stream's width but the stream-fed projections' input and the back projection's output,
    which it does not allocate, so an allocated dim of ``C`` is the channels even where
    ``C`` equals the hidden size (RecurrentGemma sizes its convolution state with
    ``self.hidden_size``, equal to ``lru_width``). A depthwise convolution called as a module
    gets its ``groups`` divided. A count read from ``self.config`` in a reshape cannot be
    divided and refuses.
    """
    counts = {mixer.channels, *mixer.heads} | {int(out_features(ctx.modules[c])) for c in mixer.linears}
    hidden = ctx.config("hidden_size")
    counts.discard(hidden)
    leaves = state_leaves(ctx.model, mixer.fqn, ctx.read)
    flows = [ctx.flow(mixer.fqn), *(ctx.leaf_flow(leaf) for leaf in leaves)]
    wanted: dict[str, set[str]] = {module: set(attrs) for module, attrs in mixer.divide.items()}
    for flow in flows:
        for use in flow.shapes:
            for module, attr in arg_reads(use):
                if attr.startswith(("missing:", "method:")):
                    continue
                value = attr_value(ctx.modules, module, attr)
                if isinstance(value, bool) or not isinstance(value, int) or value not in counts:
                    continue
                if attr.startswith("config.") or "." in attr:
                    raise Refused(
                        f"{relative(module, mixer.fqn) or 'the mixer'} sizes the channels with self.{attr} "
                        f"(line {use.line}), a global count hpgen cannot divide"
                    )
                wanted.setdefault(module, set()).add(attr)
        for use in flow.allocations:
            for module, attr in _allocated_channels(ctx.modules, use, {mixer.channels, *mixer.heads}):
                wanted.setdefault(module, set()).add(attr)
    return wanted


def _allocated_channels(modules: Mapping[str, Any], use: Any, counts: set[int]) -> list[tuple[str, str]]:
    """The ``(module, attribute)`` of each dim of an allocation that is one plain attribute of a channel count."""
    values = list(use.arg_vals)
    if len(values) == 1 and values[0].items is not None:
        values = list(values[0].items)
    found = []
    for value in values:
        reads = [r for r in value.all_reads() if not r[1].startswith(("missing:", "method:"))]
        if len(reads) != 1 or not isinstance(value.const, int) or isinstance(value.const, bool):
            continue
        module, attr = reads[0]
        if attr.startswith("config.") or "." in attr or value.const not in counts:
            continue
        if attr_value(modules, module, attr) == value.const:  # the attribute itself, not an expression of it
            found.append((module, attr))
    return found


def mixer_rows(mixer: ChannelMixer) -> list[str]:
    return [piece.fqn for piece in mixer.reduced]


def _column_placement(ctx: DeriveContext, flow: Flow, col: str, layer: str, channels: int) -> Placement:
    """``S(0)`` for a projection of ``C`` outputs, ``SS(0,k)`` for ``k`` equal packed blocks."""
    n = out_features(ctx.modules[col])
    k = n // channels
    if k == 1:
        return shard(0)
    use = next((u for u in flow.shapes if col in u.receiver), None)
    if use is None:
        raise Refused(f"{relative(col, layer)} packs {k} blocks and no split of it shows their layout")
    if use.method in ("view", "reshape"):
        dims = flat_dims(use.arg_vals)
        for a, b in zip(dims, dims[1:]):
            if a in (-1, channels) and b == k:  # [..., C, k, ...]: each channel's k values side by side
                if ctx.tp is not None and channels % ctx.tp:
                    raise Refused(
                        f"{relative(col, layer)} interleaves {k} values per channel and its "
                        f"{channels} channels do not divide over --tp {ctx.tp}"
                    )
                return shard(0)
            if a == k and b in (-1, channels):  # [..., k, C, ...]: k packed blocks
                return strided_shard(0, k)
    try:
        layout = layout_of(use, n, None)
    except UnequalBlocks:
        layout = None
    if layout == packed(k):
        return strided_shard(0, k)
    raise Refused(
        f"{relative(col, layer)} ({n} outputs) is split at line {use.line} into blocks other "
        f"than {k} equal ones of the {channels} channels"
    )


def _heads_of(param: Any, channels: int) -> int | None:
    """How many channel groups the parameter's first dim holds: ``C`` (one per channel), ``H`` for a
    per-head ``[H, C // H, ...]`` (or ``[H, n, C // H]``, Zamba's per-head ``x_proj``), else None."""
    if param.dim() < 1:
        return None
    first = int(param.shape[0])
    if first == channels:
        return channels
    if first > 1 and channels % first == 0 and channels // first in tuple(param.shape[1:]):
        return first
    return None


def _depthwise(module: Any) -> bool:
    groups = getattr(module, "groups", None)
    return isinstance(groups, int) and groups > 1 and groups == getattr(module, "in_channels", None)


def _is_norm_across(module: Any, owner: str, mixer: str) -> bool:
    from hpgen.planner.flow.runner import is_norm

    return owner != mixer and is_norm(module)


def _fed_only_by(flow: Flow, fqn: str, rows: set[str]) -> bool:
    """Whether every layer input of ``fqn`` comes from the reduced projections (not from the channels)."""
    origins = flow.edges.get(fqn)
    if not origins:
        return False
    layers = {o for o in origins if not o.startswith(("in:", "param:"))}
    return bool(layers) and layers <= rows


def _row(fqn: str, module: Any, kind: Kind, why: str) -> Placed:
    """A row-parallel ``nn.Linear`` of a mixer: weight ``S(1)``, its bias added once after the reduction."""
    piece = Placed(fqn, kind, why=why)
    piece.params["weight"] = shard(1)
    if module.bias is not None:
        piece.params["bias"] = REPLICATE
        piece.deferred.add("bias")
    return piece
