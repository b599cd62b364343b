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
   works on shards: the columns' outputs reach nothing but the rows and per-head norms;
   no norm over the full sharded width sits between them (BitNet's ``attn_sub_norm``); no
   per-head tensor made outside the module (BLOOM's ``alibi``) enters it; head counts
   divide ``--tp``; a fused projection's layout is recognised from the reshape that
   follows it (``split(split_size)`` / ``chunk(3)``: Q|K|V blocks -> ``SS(d,3)``;
   ``view(..., heads, 3, head_dim)``: per-head interleaved -> ``S(d)``; one key/value
   head packed after the queries (multi-query) is refused). Integer attributes that
   size a reshape of sharded values (``self.num_heads``, ``self.split_size``) are divided
   (``tp_divide_attrs``); a global count read from ``self.config`` there is refused.
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
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpgen.planner.entries import Derivation, Note, Placed, Refused
from hpgen.planner.flow import SIZE, Flow, leaf_kind, module_names, run_module
from hpgen.planner.latent import LatentRefused, check_broadcast, pre_projections, replicated_closure
from hpgen.planner.mixers import absent, conv_placement, per_head_placement
from hpgen.planner.split_rows import place_split_rows, reshapes_weight
from hpgen.planner.layouts import arg_reads, dim_of, last_dim, layout_of
from hpgen.planner.modules import (
    between,
    generic,
    in_features,
    is_conv1d,
    is_linear,
    is_nn_linear,
    join,
    lca,
    out_features,
    positive_int,
    prefixes,
    relative,
    returns_addressable,
)
from hpgen.planner.vocab import place_vocabulary

__all__ = ["Derivation", "Note", "Placed", "derive"]

HEAD_DIM_ATTRS = (
    "head_dim",
    "attention_head_size",
    "head_size",
    "d_head",
    "dim_head",
    "depth",
    "kv_channels",
    "size_per_head",
    "attn_head_size",
    "hidden_size_per_attention_head",
    "head_dim_qk",
    "qk_head_dim",
)
HEADS_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_attn_heads",
    "n_attention_heads",
    "num_q_heads",
    "num_head",
)
KV_HEADS_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads", "num_kv", "n_head_kv")
# forward parameters of an attention that carry one slice per head, computed outside it
PER_HEAD_INPUTS = ("alibi", "position_bias", "attn_bias", "rel_pos", "relative_position", "pos_bias", "bias")


# --------------------------------------------------------------------------- entry point


def derive(model: Any, *, tp: int | None, source: Path | None = None) -> Derivation:
    """The derived layout of ``model`` (normally on the meta device) for ``tp`` ranks."""
    if source is None:
        source = Path(inspect.getsourcefile(type(model)) or "")
    return _Deriver(model, tp, source).run()


class _Deriver:
    def __init__(self, model: Any, tp: int | None, source: Path) -> None:
        self.model = model
        self.tp = tp
        self.source = source
        self.names = module_names(model)
        self.modules = dict(model.named_modules())
        self.config = getattr(model, "config", None)
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.text_config = text
        self.result = Derivation()
        self._flows: dict[str, Flow] = {}
        self._pre: dict[str, set[str]] = {}  # block FQN -> replicated layers before its columns (norms)
        self._latent: dict[str, set[str]] = {}  # row FQN -> replicated down-projections of its group (MLA)

    def run(self) -> Derivation:
        for layer in self._layers():
            self._layer(layer)
        place_vocabulary(self.model, tp=self.tp, source=self.source, names=self.names, result=self.result)
        return self.result

    # -- decoder layers

    def _layers(self) -> list[str]:
        """Elements of module lists whose class is in the file, outermost first (not nested in another)."""
        import torch.nn as nn

        found: list[str] = []
        for fqn, module in self.modules.items():
            if not isinstance(module, nn.ModuleList):
                continue
            for name, child in module.named_children():
                element = f"{fqn}.{name}" if fqn else name
                if leaf_kind(child, self.source) != "source":
                    continue
                if any(element.startswith(other + ".") for other in found):
                    continue
                found.append(element)
        return found

    def _layer(self, layer: str) -> None:
        flow = self._flow(layer)
        linears = {fqn for fqn in flow.edges if is_linear(self.modules.get(fqn))}
        depth = _depths(flow)
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
                    self.result.note(fqn, False, str(refused))
        place_split_rows(self.result, self.modules, linears, positive_int(self._config("hidden_size")), layer)
        placed = set(self.result.placed)
        for fqn in sorted(linears):
            if not any(fqn == p or fqn.startswith(p + ".") for p in placed) and not any(
                n.target == generic(fqn) for n in self.result.notes
            ):
                self.result.note(fqn, False, "not part of a column -> row pair: kept replicated")

    def _flow(self, fqn: str) -> Flow:
        if fqn not in self._flows:
            self._flows[fqn] = run_module(self.model, fqn, self.source, names=self.names)
        return self._flows[fqn]

    def _groups(
        self, flow: Flow, linears: set[str], depth: Mapping[str, int]
    ) -> list[tuple[set[str], set[str], set[str]]]:
        """(columns, rows, per-head layers between) of each column -> row group of one layer.

        A row-parallel projection writes the stream's width (the hidden size, or the width
        the layer's stream-fed projections read) from other projections' outputs alone; the
        projections it reads are its columns, unless they are rows themselves (a reduced,
        replicated value: ``down_proj -> linear`` in Zamba2 pairs ``down_proj`` with its
        own columns, and ``linear`` stays replicated).
        """
        main = _first_marker(flow)
        found = {fqn: _sources(flow, fqn, linears, self._per_head) for fqn in linears}
        widths = {positive_int(self._config("hidden_size"))}
        widths |= {in_features(self.modules[f]) for f, src in found.items() if not src.linears}
        rows = {
            fqn
            for fqn, src in found.items()
            if src.linears
            and main not in src.markers
            and not src.stops - replicated_closure(flow, pre_projections(flow, src.linears, linears), set())
            and out_features(self.modules[fqn]) in widths
        }
        for fqn in sorted(rows):  # a "row" whose output another row mixes with columns is a column of that row
            if fqn in rows and found[fqn].linears - rows:  # (Kimi's f_b_proj: qkv_dim == hidden_size, into o_proj)
                rows -= found[fqn].linears & rows
        groups: list[tuple[set[str], set[str], set[str]]] = []
        for row in sorted(rows, key=lambda f: (depth.get(f, 0), f)):
            src = found[row]
            cols = src.linears - rows
            if not cols or src.linears & rows:  # nothing to pair, or a sharded value mixed with a reduced one
                continue
            latent = pre_projections(flow, cols, linears)  # MLA's down-projections: replicated, not columns
            if latent and cols - latent:
                cols -= latent
                self._latent[row] = latent
            merged = next((g for g in groups if g[0] & cols), None)
            if merged is None:
                groups.append((set(cols), {row}, set(src.mids)))
            else:
                merged[0].update(cols)
                merged[1].add(row)
                merged[2].update(src.mids)
        return groups

    # -- one group

    def _place_group(
        self, layer: str, flow: Flow, linears: set[str], cols: set[str], rows: set[str], mids: set[str]
    ) -> None:
        self._group_latent: set[str] = set()
        self._group_flow = flow
        what = "attention" if self._is_attention(cols, rows) else "MLP"
        for fqn in sorted(cols | rows):
            if not is_linear(self.modules[fqn]):
                raise Refused(f"{relative(fqn, layer)} is a {type(self.modules[fqn]).__name__}, not a linear layer")
            if is_nn_linear(self.modules[fqn]) and reshapes_weight(self.modules[fqn]):
                raise Refused(
                    f"{relative(fqn, layer)} is a {type(self.modules[fqn]).__name__}, whose forward reshapes its weight "
                    "(a grouped projection): a slice of its rows is not a linear layer's shard"
                )
        for fqn in sorted(mids):
            self._check_mid(fqn, cols, layer)
        raw = sorted({p for row in rows for p in _sources(flow, row, linears, self._per_head).raw})
        sharded = cols | mids
        for consumer, origins in flow.edges.items():
            if origins & sharded and consumer not in rows and consumer not in mids:
                raise Refused(
                    f"the output of {', '.join(relative(c, layer) for c in sorted(origins & cols)) or 'a column'} "
                    f"also reaches {relative(consumer, layer)}, which needs it whole"
                )
        if flow.result.item(0).whole() & sharded:
            raise Refused("the layer returns a value computed from the sharded projections")
        latent = set().union(*(self._latent.get(row, set()) for row in rows))
        if latent:
            replicated = replicated_closure(flow, latent, sharded)
            check_broadcast(flow, replicated, self._head_counts(cols, rows), layer)
        self._group_latent = latent
        side = sorted(
            {
                m
                for row in rows
                for m in _sources(flow, row, linears, self._per_head).markers
                if _per_head_input(m) and not self._switched_off(m)
            }
        )
        if side and what == "attention":
            raise Refused(
                f"the attention adds {', '.join(repr(s) for s in side)}, one slice per head computed outside "
                "it, which the plan cannot cut to this rank's heads"
            )
        self._runtime_head_check(cols, layer)
        heads = self._heads(cols, rows, layer) if what == "attention" else None
        layouts = {col: self._column_layout(flow, col, cols, heads, layer, what) for col in sorted(cols)}
        if what == "attention" and heads is not None:
            self._check_heads(cols, layouts, heads, layer)
        counts = self._sharded_counts(cols, rows, layouts, heads)
        direct = self._direct_params(raw, cols, layouts, heads, layer)
        # reshapes of the parameters sharded with the heads (dt_bias.view(1, 1, num_heads, head_dim)) size shards too
        divide = self._divided_attrs(flow, sharded | {f"param:{n}" for n, p in direct.items() if p != "R"}, counts, layer)
        self._boundaries(layer, cols, rows, mids, layouts, divide, what, direct)

    def _direct_params(
        self,
        raw: list[str],
        cols: set[str],
        layouts: Mapping[str, tuple[str, int]],
        heads: tuple[int, int, int] | None,
        layer: str,
    ) -> dict[str, str]:
        """Parameters the code between the projections reads itself, and their placement.

        One value per feature of a plainly sharded column (a learned scale on ``q``): sharded
        with it, ``S(0)``; a scalar or one head's worth (DiffLlama's lambdas): replicated, its
        gradient reduced by the block; anything else cannot follow the shards.
        """
        found: dict[str, str] = {}
        head_dim = heads[2] if heads is not None else None
        widths = {out_features(self.modules[c]) for c in cols if layouts[c] == ("S", 1)}
        col_widths = [out_features(self.modules[c]) for c in cols if layouts[c] == ("S", 1)]
        for name in raw:
            if absent(self.model, name):
                continue  # a bias the layer was built without: read as None
            try:
                param = self.model.get_parameter(name)
            except AttributeError:
                raise Refused(
                    f"the code between the projections reads a parameter hpgen cannot place ({name})"
                ) from None
            special = conv_placement(self.model, name, param, col_widths, self._group_flow.shapes) or per_head_placement(
                param, heads[0] if heads is not None else None
            )
            if special is not None:
                found[name] = special  # a depthwise conv over the columns, or one value per head (A_log)
            elif param.dim() == 1 and (param.numel() in widths or (heads is not None and param.numel() == heads[0])):
                found[name] = "S(0)"  # one value per feature of a column, or one per query head (GPT-OSS sinks)
            elif param.numel() == 1 or (param.dim() == 1 and param.numel() == head_dim):
                found[name] = "R"
            else:
                raise Refused(
                    f"the code between the projections computes with {relative(name, layer)} "
                    f"{tuple(param.shape)} directly, which does not follow the shards"
                )
        return found

    def _head_counts(self, cols: set[str], rows: set[str]) -> dict[str, int]:
        """Head counts the modules between the projections hold (``num_heads``...), by attribute name."""
        counts: dict[str, int] = {}
        for path in between(cols, lca(cols | rows)):
            for name in (*HEADS_ATTRS, *KV_HEADS_ATTRS):
                value = self._attr(path, (name,))
                if value:
                    counts[name] = value
        for name in ("num_attention_heads", "num_key_value_heads"):
            value = positive_int(self._config(name))
            if value:
                counts.setdefault(name, value)
        return counts

    def _runtime_head_check(self, cols: set[str], layer: str) -> None:
        """``parallelize`` refuses a row shard of a linear, in a module with a ``head_dim``, that would cut
        a head: refuse it here, with the module named, rather than write a plan it will not install."""
        if self.tp is None:
            return
        for col in cols:
            n = out_features(self.modules[col])
            for path in prefixes(col)[:-1]:
                if not (path == layer or path.startswith(layer + ".")):
                    continue
                head_dim = positive_int(getattr(self.modules.get(path), "head_dim", None))
                if head_dim and n % head_dim == 0 and (n // head_dim) % self.tp:
                    raise Refused(
                        f"{relative(col, layer)} has {n} outputs, {n // head_dim} heads of {relative(path, layer) or 'the layer'}'s "
                        f"head_dim {head_dim}, which do not divide over --tp {self.tp}"
                    )

    def _config(self, name: str) -> Any:
        """A value of the (text) config, or None where it is absent or per layer (transformers raises then)."""
        try:
            return getattr(self.text_config, name, None)
        except Exception:
            return None

    def _per_head(self, fqn: str) -> bool:
        """A layer of 1-D parameters of one head's size (a per-head ``q_norm``), which works on whole heads."""
        if not hasattr(self, "_head_sizes"):
            sizes = {positive_int(self._config("head_dim"))}
            for module in self.modules.values():
                sizes |= {positive_int(getattr(module, name, None)) for name in HEAD_DIM_ATTRS}
            self._head_sizes = {size for size in sizes if size}
        params = list(self.modules[fqn].parameters())
        return bool(params) and all(p.dim() == 1 and p.numel() in self._head_sizes for p in params)

    def _switched_off(self, name: str) -> bool:
        """An ``alibi`` input of a model whose config turns alibi off (Falcon's default): it arrives as None."""
        for attr in (name, f"use_{name}"):
            value = self._config(attr)
            if value is False:
                return True
        return False

    def _is_attention(self, cols: set[str], rows: set[str]) -> bool:
        common = lca(cols | rows)
        name = type(self.modules[common]).__name__.lower() if common in self.modules else ""
        if "attn" in name or "attention" in name:
            return True
        return any(self._attr(p, HEAD_DIM_ATTRS) is not None for p in between(cols, common))

    def _check_mid(self, fqn: str, cols: set[str], layer: str) -> None:
        module = self.modules[fqn]
        head_dim = self._head_dim(cols)
        sizes = {p.numel() for p in module.parameters()}
        shapes = [tuple(p.shape) for p in module.parameters()]
        if all(len(s) == 1 for s in shapes) and head_dim is not None and sizes <= {head_dim}:
            return  # a per-head norm (q_norm): runs on whole heads; its gradient is reduced
        raise Refused(
            f"{relative(fqn, layer)} ({type(module).__name__}, parameters {shapes}) sits between the column- and "
            "row-parallel projections and works across the sharded features"
        )

    # -- heads

    def _head_dim(self, cols: set[str]) -> int | None:
        for path in between(cols, lca(cols)):
            value = self._attr(path, HEAD_DIM_ATTRS)
            if value is not None:
                return value
        value = positive_int(self._config("head_dim"))
        if value:
            return value
        hidden, heads = (
            positive_int(self._config(a)) for a in ("hidden_size", "num_attention_heads")
        )
        return hidden // heads if hidden and heads else None

    def _heads(self, cols: set[str], rows: set[str], layer: str) -> tuple[int, int, int] | None:
        """(query heads, key/value heads, head_dim) of an attention group."""
        head_dim = self._head_dim(cols)
        if not head_dim:
            raise Refused("cannot tell the head size of the attention (no head_dim attribute or config value)")
        heads = None
        for path in between(cols, lca(cols | rows)):
            heads = heads or self._attr(path, HEADS_ATTRS)
        heads = heads or positive_int(self._config("num_attention_heads"))
        kv = None
        for path in between(cols, lca(cols | rows)):
            kv = kv or self._attr(path, KV_HEADS_ATTRS)
        if kv is None:
            kv = positive_int(self._config("num_key_value_heads")) or heads
        if not heads:
            raise Refused("cannot tell the number of attention heads")
        return heads, kv, head_dim

    def _attr(self, path: str, names: Iterable[str]) -> int | None:
        module = self.modules.get(path)
        for name in names:
            value = positive_int(getattr(module, name, None)) if module is not None else None
            if value:
                return value
        return None

    def _column_layout(
        self, flow: Flow, col: str, cols: set[str], heads: tuple[int, int, int] | None, layer: str, what: str
    ) -> tuple[str, int]:
        """``("S", 1)`` (plain), ``("SS", k)`` (k packed blocks) for one column projection."""
        module = self.modules[col]
        n = out_features(module)
        first = next(
            (use for use in flow.shapes if col in use.receiver and _linear_origins(use.receiver, flow) <= cols), None
        )
        if first is None:
            return "S", 1
        kind, k = layout_of(first, n, heads)
        if kind == "refuse":
            raise Refused(f"{relative(col, layer)}: {k} (the reshape at line {first.line})")
        if kind == "unknown":
            if what == "attention" and heads is not None and n not in (heads[0] * heads[2], heads[1] * heads[2]):
                raise Refused(
                    f"{relative(col, layer)} packs several projections ({n} features) and hpgen cannot tell their "
                    f"layout from the reshape at line {first.line}"
                )
            return "S", 1
        return kind, k

    def _check_heads(
        self, cols: set[str], layouts: Mapping[str, tuple[str, int]], heads: tuple[int, int, int], layer: str
    ) -> None:
        q, kv, head_dim = heads
        tp = self.tp
        for col in sorted(cols):
            n = out_features(self.modules[col])
            kind, k = layouts[col]
            per_block = n // k if kind == "SS" else n
            if kind == "S" and k == 1 and n in (q, kv) and n % head_dim:
                units = n  # one value per head (a per-head gate)
            elif per_block % head_dim and not (kind == "S" and k > 1 and per_block % k == 0):
                raise Refused(f"{relative(col, layer)} has {n} features, not a whole number of heads of {head_dim}")
            else:
                units = per_block // head_dim
            if kind == "S" and k > 1:  # interleaved per head or per key/value group
                units = k
            if tp is not None and units % tp:
                raise Refused(
                    f"{relative(col, layer)} holds {units} heads (or key/value groups), which do not divide over "
                    f"--tp {tp}"
                )
        if tp is not None and (q % tp or kv % tp):
            raise Refused(f"{q} query and {kv} key/value heads do not divide over --tp {tp}")

    def _sharded_counts(
        self,
        cols: set[str],
        rows: set[str],
        layouts: Mapping[str, tuple[str, int]],
        heads: tuple[int, int, int] | None,
    ) -> set[int]:
        counts: set[int] = set()
        for col in cols:
            n = out_features(self.modules[col])
            counts.add(n)
            kind, k = layouts[col]
            if kind == "SS":
                counts.add(n // k)
        for row in rows:
            counts.add(in_features(self.modules[row]))
        if heads is not None:
            q, kv, head_dim = heads
            counts |= {q, kv, q * head_dim, kv * head_dim}
            counts.discard(head_dim)
        counts.discard(1)
        counts.discard(0)
        return counts

    def _divided_attrs(self, flow: Flow, sharded: set[str], counts: set[int], layer: str) -> dict[str, set[str]]:
        """Module FQN -> integer attributes that size reshapes of the sharded values."""
        wanted: dict[str, set[str]] = {}
        replicated: set[tuple[str, str]] = set()
        for use in flow.shapes:
            origins = use.receiver
            if origins & sharded and use.method in ("chunk", "split", "tensor_split") and dim_of(use) in (1, -3):
                raise Refused(
                    f"{relative(use.module, layer) or 'the layer'} splits the heads into groups ({use.method} along "
                    f"dim {dim_of(use)}, line {use.line}): a rank's contiguous heads are not whole groups"
                )
            if origins & sharded and use.method in ("view", "reshape"):
                last = last_dim(use)
                if (
                    last is not None
                    and any(
                        module == SIZE and not (set(attr.split(",")) & sharded) for module, attr in last.all_reads()
                    )
                    and last.const != -1
                ):
                    raise Refused(
                        f"{relative(use.module, layer) or 'the layer'} reshapes the sharded values to a width read "
                        f"from an unsharded tensor's size (line {use.line}), which a shard does not have"
                    )
            for module, attr in arg_reads(use):
                if attr.startswith(("missing:", "method:")):
                    continue
                value = self._value(module, attr)
                if not isinstance(value, int) or isinstance(value, bool) or value not in counts:
                    continue
                if _is_head_dim_name(attr):
                    continue
                if origins & sharded:
                    if attr.startswith("config."):
                        raise Refused(
                            f"{relative(module, layer) or 'the layer'} reshapes sharded values with self.{attr} "
                            f"(line {use.line}), a global count hpgen cannot divide"
                        )
                    wanted.setdefault(module, set()).add(attr)
                elif origins:
                    replicated.add((module, attr))
        for module, attrs in wanted.items():
            both = sorted(a for a in attrs if (module, a) in replicated)
            if both:
                raise Refused(
                    f"self.{both[0]} of {relative(module, layer) or 'the layer'} sizes both the replicated input and "
                    "the sharded heads"
                )
            for attr in attrs:
                if "." in attr:
                    raise Refused(f"self.{attr} of {relative(module, layer)} sizes the sharded heads but is nested")
        return wanted

    def _value(self, module: str, attr: str) -> Any:
        obj: Any = self.modules.get(module)
        for part in attr.split("."):
            obj = getattr(obj, part, None)
        return obj

    # -- boundaries

    def _boundaries(
        self,
        layer: str,
        cols: set[str],
        rows: set[str],
        mids: set[str],
        layouts: Mapping[str, tuple[str, int]],
        divide: Mapping[str, set[str]],
        what: str,
        direct: Mapping[str, str],
    ) -> None:
        common = lca(cols | rows)
        if not (common == layer or common.startswith(layer + ".")):
            common = layer
        pieces: list[Placed] = []
        block = self._clean(common, cols, rows, mids, full=True)
        if block is not None:
            why = f"{what}: column- and row-parallel projections"
            if self._group_latent:
                names = ", ".join(sorted(relative(p, common) for p in self._group_latent))
                why += f"; the latent down-projection {names} (shared by the heads) replicated in the block"
            placed = Placed(common, "block", inputs=block, why=why)
            self._params(placed, cols, rows, layouts)
            pieces.append(placed)
        else:
            column = lca(cols)
            inputs = None
            if not any(r == column or r.startswith(column + ".") for r in rows) and column not in cols:
                inputs = self._clean(column, cols, set(), mids, full=False)
            if inputs is not None:
                placed = Placed(
                    column,
                    "col_block",
                    inputs=inputs,
                    why=f"{what}: column-parallel projections; "
                    "the output stays sharded for the row-parallel projection after it",
                )
                self._params(placed, cols, set(), layouts)
                pieces.append(placed)
            else:
                if direct:
                    raise Refused(
                        f"the code between the projections reads {relative(sorted(direct)[0], layer)} directly and "
                        "needs a block around it, and no module around the columns returns only their output"
                    )
                if mids:
                    raise Refused(
                        f"{', '.join(relative(m, layer) for m in sorted(mids))} between the projections needs a "
                        "block to reduce its gradient in, and no module around the columns returns only their output"
                    )
                for col in sorted(cols):
                    if not is_nn_linear(self.modules[col]):
                        raise Refused(f"{relative(col, layer)} would be a boundary of its own but is not an nn.Linear")
                    placed = Placed(col, "col_leaf", why=f"{what}: column-parallel nn.Linear (output stays sharded)")
                    self._params(placed, {col}, set(), layouts)
                    pieces.append(placed)
            for row in sorted(rows):
                if not is_nn_linear(self.modules[row]):
                    raise Refused(f"{relative(row, layer)} would be a boundary of its own but is not an nn.Linear")
                placed = Placed(row, "row_leaf", why=f"{what}: row-parallel nn.Linear (input arrives sharded)")
                self._params(placed, set(), {row}, layouts)
                pieces.append(placed)
        for name, placement in direct.items():
            owner = next((p for p in pieces if p.kind in ("block", "col_block") and name.startswith(p.fqn + ".")), None)
            if owner is None:
                raise Refused(f"{relative(name, layer)} is read directly outside the block of its projections")
            if placement != "R":
                owner.params[relative(name, owner.fqn)] = placement
            else:
                owner.grad_reduce.add(relative(name, owner.fqn))
        for piece in pieces:  # replicated layers the sharded body runs through: their gradients are partial
            if piece.kind in ("block", "col_block"):
                for leaf in self._pre.get(piece.fqn, set()) | mids:
                    if leaf.startswith(piece.fqn + "."):
                        piece.grad_reduce |= {
                            join(relative(leaf, piece.fqn), n) for n, _ in self.modules[leaf].named_parameters()
                        }
        for piece in pieces:
            if piece.fqn in self.result.placed:
                raise Refused(f"{relative(piece.fqn, layer) or layer} would hold two groups")
        for piece in pieces:
            self.result.placed[piece.fqn] = piece
            self.result.note(piece.fqn, True, piece.why)
        for module, attrs in divide.items():
            owner = self.result.placed.get(module)
            if owner is None:
                owner = self.result.placed[module] = Placed(module, "attrs", why="sizes of the sharded heads")
            owner.divide |= attrs

    def _params(self, placed: Placed, cols: set[str], rows: set[str], layouts: Mapping[str, tuple[str, int]]) -> None:
        for col in sorted(cols):
            module = self.modules[col]
            kind, k = layouts[col]
            dim = 1 if is_conv1d(module) else 0
            text = f"SS({dim},{k})" if kind == "SS" else f"S({dim})"
            placed.params[join(relative(col, placed.fqn), "weight")] = text
            if getattr(module, "bias", None) is not None:
                placed.params[join(relative(col, placed.fqn), "bias")] = f"SS(0,{k})" if kind == "SS" else "S(0)"
        for row in sorted(rows):
            module = self.modules[row]
            dim = 0 if is_conv1d(module) else 1
            placed.params[join(relative(row, placed.fqn), "weight")] = f"S({dim})"
            if getattr(module, "bias", None) is not None:
                name = join(relative(row, placed.fqn), "bias")
                placed.params[name] = "R"
                placed.deferred.add(name)

    def _pre_chain(self, flow: Flow, start: Iterable[str], pre: set[str]) -> set[str]:
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

    def _clean(self, fqn: str, cols: set[str], rows: set[str], mids: set[str], *, full: bool) -> tuple[str, ...] | None:
        """The inputs of ``fqn`` feeding the columns when it can be the group's block, else None.

        ``full``: the block holds the rows and returns their output alone; otherwise it holds
        only the columns and returns their (sharded) output alone.
        """
        module = self.modules.get(fqn)
        if module is None or leaf_kind(module, self.source) != "source" or not fqn:
            return None
        if not returns_addressable(type(module)):
            return None  # returns a list: the plan addresses a value or the first item of a tuple
        flow = self._flow(fqn)
        group = cols | rows | mids
        pre = set()
        latent = self._group_latent if full else set()
        before = replicated_closure(flow, latent, group) | _fed_columns(flow, cols, group) if full else set()
        for leaf, origins in flow.edges.items():
            if leaf in group:
                continue
            params = [p for p in self.modules[leaf].parameters()]
            if origins and all(o.startswith("in:") for o in origins) and all(p.dim() == 1 for p in params):
                pre.add(leaf)  # a norm of the replicated input before the columns
                continue
            if leaf in before:
                pre.add(leaf)  # a latent down-projection (and its norm), replicated in the block
                continue
            return None
        outputs = flow.result.item(0).whole()
        allowed = rows if full else cols | mids
        if not outputs or not outputs <= allowed | {o for o in outputs if o.startswith("in:")}:
            return None
        inputs: set[str] = set()
        for col in cols:
            pending, seen = list(flow.inputs.get(col, ())), set()
            if any(o in pre for o in pending) and any(o in latent for o in self._pre_chain(flow, pending, pre)):
                # an up-projection of a latent (MLA's kv_b_proj): its data comes through the latent; the
                # other markers mixed in come from the latent cache's update (cache, kwargs), not data
                pending = [o for o in pending if not o.startswith("in:")]
            while pending:  # through the replicated layers before the columns, to the block's inputs
                origin = pending.pop()
                if origin in seen:
                    continue
                seen.add(origin)
                if origin.startswith("in:"):
                    inputs.add(origin[3:])
                elif origin in pre:
                    pending.extend(flow.inputs.get(origin, ()))
                else:
                    return None
        if not inputs:
            return None
        self._pre[fqn] = pre
        if full and any(o.startswith("in:") for o in outputs):
            return None  # a residual (or another input) added to the output inside the module
        if not full and any(o[3:] in inputs for o in outputs if o.startswith("in:")):
            return None
        return tuple(sorted(inputs))

    # -- embeddings


# --------------------------------------------------------------------------- graph helpers


@dataclass
class _Sources:
    linears: set[str] = field(default_factory=set)
    markers: set[str] = field(default_factory=set)
    mids: set[str] = field(default_factory=set)  # per-head norms passed through
    stops: set[str] = field(default_factory=set)  # other layers: their output counts as replicated
    raw: set[str] = field(default_factory=set)  # parameters the code between reads directly (F.conv1d(x, w))


def _sources(flow: Flow, fqn: str, linears: set[str], per_head: Any = None) -> _Sources:
    """The projections and inputs feeding ``fqn``, looking through per-head norms (``q_norm``).

    Any other layer on the way (a norm over the whole width, a convolution) ends the walk:
    what it computes is not a shard of a projection's output.
    """
    found = _Sources()
    pending = list(flow.edges.get(fqn, ()))
    seen: set[str] = set()
    while pending:
        origin = pending.pop()
        if origin in seen:
            continue
        seen.add(origin)
        if origin.startswith("in:"):
            found.markers.add(origin[3:])
        elif origin.startswith("param:"):
            found.raw.add(origin[len("param:") :])
        elif origin in linears:
            found.linears.add(origin)
        elif origin in flow.edges:
            if per_head is not None and not per_head(origin):
                found.stops.add(origin)
                continue
            found.mids.add(origin)
            pending.extend(flow.edges[origin])
    return found


def _fed_columns(flow: Flow, cols: set[str], group: set[str]) -> set[str]:
    """Layers computed from the inputs alone whose outputs reach only the columns (and each other):
    MLA's ``q_a_proj`` and ``q_a_layernorm`` before ``q_b_proj``, replicated in the block."""
    found: set[str] = set()
    changed = True
    while changed:
        changed = False
        for leaf, origins in flow.edges.items():
            if leaf in found or leaf in group or not origins:
                continue
            if not all(o.startswith("in:") or o in found for o in origins):
                continue
            consumers = {c for c, o in flow.edges.items() if leaf in o}
            if consumers and consumers <= cols | found | {c for c in consumers if c not in group and c not in cols}:
                found.add(leaf)
                changed = True
    # keep only those whose outputs end in the columns
    useful: set[str] = set()
    changed = True
    while changed:
        changed = False
        for leaf in found - useful:
            consumers = {c for c, o in flow.edges.items() if leaf in o}
            if consumers and consumers <= cols | useful:
                useful.add(leaf)
                changed = True
    return useful


def _first_marker(flow: Flow) -> str | None:
    """The layer's first ``forward`` parameter: the residual stream."""
    return flow.first_input


def _depths(flow: Flow) -> dict[str, int]:
    memo: dict[str, int] = {}

    def depth(node: str, stack: frozenset[str] = frozenset()) -> int:
        if node in memo:
            return memo[node]
        if node in stack or node not in flow.edges:
            return 0
        value = 1 + max((depth(o, stack | {node}) for o in flow.edges[node]), default=0)
        memo[node] = value
        return value

    for node in flow.edges:
        depth(node)
    return memo


def _linear_origins(origins: frozenset[str], flow: Flow) -> set[str]:
    return {o for o in origins if o in flow.edges}


def _is_head_dim_name(attr: str) -> bool:
    """``head_dim``, ``attention_head_size``: the size of one head (never divided), not ``all_head_size``."""
    leaf = attr.rpartition(".")[2].lower()
    if leaf.startswith(("all_", "total_", "num_", "n_")):
        return False
    return leaf in HEAD_DIM_ATTRS or leaf.endswith(("head_dim", "head_size"))


def _per_head_input(name: str) -> bool:
    lowered = name.lower()
    return any(part in lowered for part in PER_HEAD_INPUTS) and "mask" not in lowered
