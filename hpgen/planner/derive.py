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
   head packed after the queries (multi-query) is refused). Integer attributes that
   size a reshape of sharded values (``self.num_heads``, ``self.split_size``) are divided
   (``tp_divide_attrs``); a global count read from ``self.config`` there is refused. An
   attention that splits its heads into parts working together (DiffLlama's ``chunk(2)``
   pairing head ``i`` with ``i + H/2``) gets a strided cut of every part,
   ``SS(0,k)`` (:mod:`~hpgen.planner.head_parts`).
3. **Boundaries.** The group's lowest common module is one block (``R -> R`` in,
   ``P(sum) -> R`` out) when its ``forward`` returns the row's output alone (no residual
   added inside, no norm after). Otherwise the columns' common module becomes a block
   whose output stays sharded (BERT's self-attention, ``S(-1) -> S(-1)``), or each column
   ``nn.Linear`` a boundary of its own, and each row ``nn.Linear`` a row-parallel boundary
   taking the sharded input (OPT's ``fc1``/``fc2`` in the decoder layer itself).
4. Parameters the code between the projections reads itself (a per-feature scale, GPT-OSS's
   per-head ``sinks``) are sharded with them or kept replicated in the block; the
   vocabulary is placed by :mod:`hpgen.planner.vocab`.

Every group or module left replicated gets a note saying why; :mod:`hpgen.planner`
writes the notes into the plan.

This module walks the decoder layers and takes each group through the steps, each a base
class of the deriver: :mod:`~hpgen.planner.groups` (1: the groups, and what lies between
their projections), :mod:`~hpgen.planner.heads` and :mod:`~hpgen.planner.reshapes` (2: the
heads, fused layouts, attributes to divide; :mod:`~hpgen.planner.head_cuts`, per-head inputs
made outside the attention; :mod:`~hpgen.planner.head_parts`, heads split into parts),
:mod:`~hpgen.planner.derived_blocks` (3 and 4: the boundaries and their parameters).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from hpgen.planner.derived_blocks import BlockChoice
from hpgen.planner.entries import Contradicted, Derivation, HeadCut, Note, Placed, Refused
from hpgen.planner.flow.caller_nones import caller_nones
from hpgen.planner.flow import Flow, leaf_kind, module_names, run_module
from hpgen.planner.gathered import check_gathered, gathered_columns
from hpgen.planner.groups import Group, GroupFinding, depths, direct_params, first_marker, sources
from hpgen.planner.head_cuts import head_inputs
from hpgen.planner.head_parts import HeadParts
from hpgen.planner.heads import HeadRules, per_head_input
from hpgen.planner.latent import LatentRefused, check_broadcast, replicated_closure
from hpgen.planner.modules import generic, is_linear, is_nn_linear, lca, positive_int, relative
from hpgen.planner.reshapes import ReshapeRules
from hpgen.planner.split_rows import place_split_rows, reshapes_weight
from hpgen.planner.vocab import place_vocabulary
from hpgen.placement import REPLICATE

__all__ = ["Derivation", "Note", "Placed", "derive"]


def derive(model: Any, *, tp: int | None, source: Path | None = None) -> Derivation:
    """The derived layout of ``model`` (normally on the meta device) for ``tp`` ranks."""
    if source is None:
        source = Path(inspect.getsourcefile(type(model)) or "")
    return _Deriver(model, tp, source).run()


class _Deriver(GroupFinding, HeadParts, ReshapeRules, BlockChoice):
    """The derivation of one model: each decoder layer's groups placed, then the vocabulary."""

    def __init__(self, model: Any, tp: int | None, source: Path) -> None:
        self.model = model
        self.tp = tp
        self.source = source
        self.read: Path | tuple[Path, ...] = source  # the files whose forwards are interpreted (see _layers)
        self.names = module_names(model)
        self.modules = dict(model.named_modules())
        self.config = getattr(model, "config", None)
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.text_config = text
        self.result = Derivation()
        self._flows: dict[str, Flow] = {}
        self._pre: dict[str, set[str]] = {}  # block FQN -> replicated layers before its columns (norms)
        self._latent: dict[str, set[str]] = {}  # row FQN -> replicated down-projections of its group (MLA)
        self.model_heads = HeadRules(model, self.modules, tp, self._config)  # the head rules of the model
        self.heads = self.model_heads  # and of the decoder layer being placed (see _layer)

    def run(self) -> Derivation:
        for layer in self._layers():
            self._layer(layer)
        place_vocabulary(self.model, tp=self.tp, source=self.source, names=self.names, result=self.result)
        return self.result

    # -- decoder layers

    def _layers(self) -> list[str]:
        """Elements of module lists whose class is in the file, outermost first (not nested in another)."""
        import torch.nn as nn

        found = self._elements(self.source)
        if not found:
            # a composite model whose decoder layers are in another modeling file (Fuyu's language model
            # is a PersimmonModel): read that file's forwards too; only the lowered file's classes become
            # blocks (_clean), so its groups shard as wrapped leaves
            others = {
                Path(path)
                for module in self.modules.values()
                if isinstance(module, nn.ModuleList)
                for child in module.children()
                if (path := _source_file(type(child))) is not None and "/transformers/models/" in path
            }
            if others:
                self.read = (self.source, *sorted(others))
                found = self._elements(self.read)
        return found

    def _elements(self, read: Path | tuple[Path, ...]) -> list[str]:
        import torch.nn as nn

        found: list[str] = []
        for fqn, module in self.modules.items():
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

    def _layer(self, layer: str) -> None:
        flow = self._flow(layer)
        self.heads = self.model_heads.for_layer(flow)
        linears = {fqn for fqn in flow.edges if is_linear(self.modules.get(fqn))}
        linears -= self._channel_mixers(layer)
        depth = depths(flow)
        groups = self._groups(flow, linears, depth)
        for cols, rows, mids in groups:
            try:
                self._place_group(layer, flow, linears, cols, rows, mids)
            except Refused as refused:
                latent = set().union(*(self._latent.pop(row, set()) for row in rows))
                if latent:  # the group with its latent projections as columns: the reason it had before
                    cols = cols | latent
                    try:
                        self._place_group(layer, flow, linears, cols, rows, mids)
                        continue
                    except Refused as plain:
                        if not isinstance(refused, LatentRefused):  # a latent's own refusal says more
                            refused = plain
                for fqn in sorted(cols | rows):
                    self.result.note(
                        fqn, False, str(refused), needs_whole=refused.consumer if isinstance(refused, Contradicted) else ""
                    )
        place_split_rows(self.result, self.modules, linears, positive_int(self._config("hidden_size")), layer)
        placed = set(self.result.placed)
        for fqn in sorted(linears):
            if not any(fqn == p or fqn.startswith(p + ".") for p in placed) and not any(
                n.target == generic(fqn) for n in self.result.notes
            ):
                self.result.note(fqn, False, "not part of a column -> row pair: kept replicated")

    def _channel_mixers(self, layer: str) -> set[str]:
        """Place the state-space mixers of ``layer`` (:mod:`hpgen.planner.channels`); the projections they hold."""
        from hpgen.planner.channels import channel_attrs, find_channel_mixer

        taken: set[str] = set()
        self._current_layer = layer
        hidden = positive_int(self._config("hidden_size"))
        for fqn in sorted(self.modules):
            if not (fqn == layer or fqn.startswith(layer + ".")) or any(fqn.startswith(t + ".") for t in taken):
                continue
            try:
                mixer = find_channel_mixer(self, fqn, hidden)
                divide = channel_attrs(self, mixer) if mixer is not None and mixer.block is not None else {}
            except Refused as refused:
                self.result.note(fqn, False, str(refused))
                taken.add(fqn)
                continue
            if mixer is None:
                continue
            taken.add(fqn)
            for piece in ([mixer.block] if mixer.block is not None else []) + mixer.reduced:
                self.result.placed[piece.fqn] = piece
                self.result.note(piece.fqn, True, piece.why)
            for module, attrs in divide.items():
                owner = self.result.placed.get(module) or self.result.placed.setdefault(
                    module, Placed(module, "attrs", why="sizes of the sharded channels")
                )
                owner.divide |= attrs
        return {f for f in self._linears_under(taken)}

    def _linears_under(self, roots: set[str]) -> set[str]:
        return {f for f, m in self.modules.items() if is_linear(m) and any(f.startswith(r + ".") for r in roots)}

    def _flow(self, fqn: str) -> Flow:
        if fqn not in self._flows:
            nones = caller_nones(self.model, fqn)
            self._flows[fqn] = run_module(self.model, fqn, self.read, names=self.names, nones=nones)  # type: ignore[arg-type]
        return self._flows[fqn]

    # -- one group

    def _place_group(
        self, layer: str, flow: Flow, linears: set[str], cols: set[str], rows: set[str], mids: set[str]
    ) -> None:
        group = Group(flow)
        what = "attention" if self.heads.is_attention(cols, rows) else "MLP"
        for fqn in sorted(cols | rows):
            if not is_linear(self.modules[fqn]):
                raise Refused(f"{relative(fqn, layer)} is a {type(self.modules[fqn]).__name__}, not a linear layer")
            if is_nn_linear(self.modules[fqn]) and reshapes_weight(self.modules[fqn]):
                raise Refused(
                    f"{relative(fqn, layer)} is a {type(self.modules[fqn]).__name__}, whose forward reshapes its weight "
                    "(a grouped projection): a slice of its rows is not a linear layer's shard"
                )
        for fqn in sorted(mids):
            self._check_mid(fqn, cols, layer, rows)
        raw = sorted({p for row in rows for p in sources(flow, row, linears, self.heads.per_head).raw})
        sharded = cols | mids
        # a column reading another column's output whole (Doge's dt_proj): gathered on entry, checked with the heads
        gathered = gathered_columns(flow, cols, linears, self.modules, self.heads.per_head, first_marker(flow))
        for consumer, origins in flow.edges.items():
            if origins & sharded and consumer not in rows and consumer not in mids and consumer not in gathered:
                raise Contradicted(
                    f"the output of {', '.join(relative(c, layer) for c in sorted(origins & cols)) or 'a column'} "
                    f"also reaches {relative(consumer, layer)}, which needs it whole",
                    consumer,
                )
        if flow.result.item(0).whole() & sharded:
            raise Refused("the layer returns a value computed from the sharded projections")
        latent = set().union(*(self._latent.get(row, set()) for row in rows))
        if latent:
            replicated = replicated_closure(flow, latent, sharded)
            check_broadcast(flow, replicated, self.heads.head_counts(cols, rows), layer)
        group.latent = latent
        side = sorted(
            {
                m
                for row in rows
                for m in sources(flow, row, linears, self.heads.per_head).markers
                if per_head_input(m) and not self.heads.switched_off(m)
            }
        )
        heads = group.heads = self.heads.query_kv_heads(cols, rows, layer) if what == "attention" else None
        # heads split into parts that work together (differential attention): a strided cut of every part
        parts = group.parts = self._head_parts(flow, cols, rows, layer, heads)
        replicated = {c for c, layout in (parts.layouts if parts else {}).items() if layout[0] == "RS"}
        self.heads.check_runtime_heads(cols - replicated, layer)
        cut: dict[str, HeadCut] = {}
        if side and heads:
            common = lca(cols | rows)
            common = common if common == layer or common.startswith(layer + ".") else layer
            cut = head_inputs(self.heads, self._flow(common), common, rows, heads[0])
        if parts is not None:
            layouts = dict(parts.layouts)  # the parts rule checked the heads against --tp itself
        else:
            plain = sorted(cols - set(gathered))
            layouts = {col: self._column_layout(flow, col, cols, heads, layer, what) for col in plain}
            layouts.update({col: ("S", 1) for col in gathered})  # its outputs are whole values, one per head
        check_gathered(gathered, self.modules, layouts, heads if what == "attention" else None, self.tp, layer)
        if what == "attention" and heads is not None and parts is None:
            self.heads.check_heads(cols, layouts, heads, layer)
        counts = self._sharded_counts(cols - replicated, rows, layouts, heads)
        direct = direct_params(self.model, self.modules, group, raw, cols, layouts, heads, layer)
        # reshapes of the parameters sharded with the heads (dt_bias.view(1, 1, num_heads, head_dim)) size shards too
        divide = self._divided_attrs(
            flow,
            sharded | {f"param:{n}" for n, p in direct.items() if p != REPLICATE},
            counts,
            layer,
            parts.lines if parts else set(),
        )
        for module, attrs in (parts.divide if parts else {}).items():
            divide.setdefault(module, set()).update(attrs)
        self._boundaries(group, layer, cols, rows, mids, layouts, divide, what, direct, cut, set(gathered))

    def _config(self, name: str) -> Any:
        """A value of the (text) config, or None where it is absent or per layer (transformers raises then)."""
        try:
            return getattr(self.text_config, name, None)
        except Exception:
            return None


def _source_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except TypeError:
        return None
