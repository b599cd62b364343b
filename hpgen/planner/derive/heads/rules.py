"""Step 2 of deriving a plan, attention rules: the heads of a group and whether they divide over ``--tp``.

Head counts and sizes come from the modules between a group's projections
(``self.num_heads``, ``self.head_dim`` under their many names) or the config; a group is
attention when its module says so or a module in it has a head size. Per-head layers
(``q_norm``) run on whole heads; a per-head tensor made outside the attention (an
``alibi``) cannot be cut to a rank's heads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from hpgen.planner.derive.column_layouts import ColumnLayout
from hpgen.planner.derive.heads.attr_names import HEAD_DIM_ATTRS, HEADS_ATTRS, KV_HEADS_ATTRS
from hpgen.planner.derive.heads.counts import Heads
from hpgen.planner.derive.heads.maps import per_head_map
from hpgen.planner.derive.heads.per_head_params import param_use, per_head_view
from hpgen.planner.derive.heads.shares import HeadShares, NoHeadForRank, head_shares
from hpgen.planner.derive.placed import NoQueryHead, Refused
from hpgen.planner.flow import Flow
from hpgen.planner.model.modules import between, is_linear, lca, out_features, positive_int, prefixes, relative
from hpgen.core.shards import row_heads

__all__ = [
    "PER_HEAD_INPUTS",
    "HeadRules",
    "is_head_dim_name",
    "normalized_heads",
    "per_head_input",
]


# forward parameters of an attention that carry one slice per head, computed outside it
PER_HEAD_INPUTS = ("alibi", "position_bias", "attn_bias", "rel_pos", "relative_position", "pos_bias", "bias")


class HeadRules:
    """The attention rules of a derivation: head counts and sizes, and which layers work on whole heads.

    One is made per model (:func:`hpgen.planner.derive.derivation.derive`) and one per decoder layer from it
    (:meth:`for_layer`), with that layer's flow; they share what does not change during a
    derivation (the head sizes and counts the modules hold, the linear layers' widths).
    """

    def __init__(
        self,
        model: Any,
        modules: Mapping[str, Any],
        tp: int | None,
        config: Callable[[str], Any],
        flow: Flow | None = None,
        cache: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.modules = modules
        self.tp = tp
        self.config = config  # a (text) config value by name, None where absent
        self.flow = flow  # the decoder layer's flow
        self._cache: dict[str, Any] = {} if cache is None else cache

    def for_layer(self, flow: Flow) -> HeadRules:
        """The rules inside the decoder layer whose flow is ``flow``."""
        return HeadRules(self.model, self.modules, self.tp, self.config, flow, self._cache)

    @property
    def meta_arguments(self) -> dict[Any, Any]:
        """The arguments meta-device forwards of the model gave its modules, kept for the derivation
        (:func:`hpgen.planner.derive.heads.input_dims.head_layouts`): one forward serves every decoder layer."""
        return self._cache.setdefault("meta_arguments", {})

    def head_counts(self, cols: AbstractSet[str], rows: AbstractSet[str]) -> dict[str, int]:
        """Head counts the modules between the projections hold (``num_heads``...), by attribute name."""
        counts: dict[str, int] = {}
        for path in between(cols, lca(cols | rows)):
            for name in (*HEADS_ATTRS, *KV_HEADS_ATTRS):
                value = self._attr(path, (name,))
                if value:
                    counts[name] = value
        for name in ("num_attention_heads", "num_key_value_heads"):
            value = positive_int(self.config(name))
            if value:
                counts.setdefault(name, value)
        return counts

    def check_runtime_heads(self, cols: Iterable[str], layer: str) -> None:
        """``parallelize`` refuses a row shard of a linear, in a module with a ``head_dim``, that would cut
        a head: refuse it here, with the module named, rather than write a plan it will not install."""
        if self.tp is None:
            return
        for col in sorted(cols):  # sorted: the message names the same projection on every run
            n = out_features(self.modules[col])
            for path in prefixes(col)[:-1]:
                if not (path == layer or path.startswith(layer + ".")):
                    continue
                head_dim = positive_int(getattr(self.modules.get(path), "head_dim", None))
                if not head_dim or n % head_dim or _multi_query(self.modules.get(path), n, head_dim):
                    continue  # a multi-query [queries | key | value]: its layout cuts the query heads alone
                held = row_heads(self.modules[path], relative(col, path), n, head_dim)  # as parallelize counts
                if held % self.tp:
                    where = relative(path, layer) or "the layer"
                    size = f"{where}'s head_dim {head_dim}" if held * head_dim == n else f"{n // held} features ({where})"
                    raise Refused(
                        f"{relative(col, layer)} has {n} outputs, {held} heads of {size}, which do not divide over "
                        f"--tp {self.tp}"
                    )

    def check_mask_heads(self, cols: AbstractSet[str], rows: AbstractSet[str], heads: Heads) -> None:
        """Refuse an attention whose ``attention_mask`` carries one slice per head: transformers 5.25's ALiBi
        Falcon adds its per-head bias, made by the model for all heads, into the mask. A rank holding some heads
        would add every head's bias (a crash, or the wrong heads' bias), and hpgen does not cut a mask to a
        rank's heads, so the attention stays whole. Asked only where the config turns ALiBi on (a meta forward)."""
        if self.tp is None or self.config("alibi") is not True or heads.query < 2:
            return
        import inspect

        from hpgen.planner.derive.heads.input_dims import head_layouts

        common = lca(cols | rows)
        module = self.modules.get(common)
        if module is None or "attention_mask" not in inspect.signature(type(module).forward).parameters:
            return
        try:
            layout = head_layouts(self.model, {common: ("attention_mask",)}, heads.query, recorded=self.meta_arguments)
        except RuntimeError as error:
            raise Refused(f"ALiBi is on and hpgen cannot tell whether the attention_mask carries the heads: {error}") from None
        found = layout[(common, "attention_mask")]
        if found.kind != "none":
            raise Refused(
                f"its attention_mask {found.shape} carries ALiBi's bias for all {heads.query} heads, made outside "
                "the attention; hpgen does not cut a mask to a rank's heads"
            )

    def per_head(self, fqn: str) -> bool:
        """A layer that works on whole heads: 1-D parameters of one head's size (a per-head ``q_norm``), or a
        weightless torch norm over a whole number of heads' features (:func:`normalized_heads`)."""
        if "head_sizes" not in self._cache:
            sizes = {positive_int(self.config("head_dim"))}
            for module in self.modules.values():
                sizes |= {positive_int(getattr(module, name, None)) for name in HEAD_DIM_ATTRS}
            self._cache["head_sizes"] = {size for size in sizes if size}
        head_sizes = self._cache["head_sizes"]
        module = self.modules[fqn]
        params = list(module.parameters())
        if params and all(p.dim() == 1 and p.numel() in head_sizes for p in params):
            return True
        if not params and normalized_heads(module, head_sizes) is not None:
            return True  # torch's weightless norm over whole heads
        return self.maps_heads(fqn) or self.norms_heads(fqn) or self.scales_heads(fqn)

    def _head_view(self, fqn: str) -> int | None:
        """``d`` when leaf ``fqn`` reads a per-head view ``[..., heads, d]`` of one column's output."""
        if self.flow is None:
            return None
        if "linear_widths" not in self._cache:  # the model's modules do not change during a derivation
            self._cache["linear_widths"] = {f: out_features(m) for f, m in self.modules.items() if is_linear(m)}
        return per_head_view(self.flow, fqn, self._cache["linear_widths"])

    def norms_heads(self, fqn: str) -> bool:
        """A norm without parameters over a per-head view (an unweighted RMSNorm of each value head).

        A norm of the modeling file normalises the last dim (one head's features here); torch's
        norms only when their ``normalized_shape`` is that one dim (a ``GroupNorm`` mixes channels).
        """
        import torch.nn as nn

        from hpgen.planner.flow.runner import is_norm

        module = self.modules[fqn]
        if any(True for _ in module.parameters()) or not is_norm(module) or isinstance(module, nn.GroupNorm):
            return False
        size = self._head_view(fqn)
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return size is not None and tuple(module.normalized_shape) == (size,)
        return size is not None

    def scales_heads(self, fqn: str) -> bool:
        """A leaf over a per-head view whose parameters are per-head scales ``[heads, d]`` (sharded ``S(0)``)."""
        params = dict(self.modules[fqn].named_parameters())
        size = self._head_view(fqn) if params else None
        if size is None:
            return False
        counts = self._all_head_counts()
        return all(
            p.dim() == 2 and p.shape[1] == size and p.shape[0] in counts and param_use(self.model, f"{fqn}.{n}") == "scale"
            for n, p in params.items()
        )

    def _all_head_counts(self) -> set[int]:
        """Every head count a module or the config holds (``num_heads``, ``num_key_value_heads``...)."""
        if "head_counts" not in self._cache:
            counts = {positive_int(self.config(n)) for n in (*HEADS_ATTRS, *KV_HEADS_ATTRS)}
            for module in self.modules.values():
                counts |= {positive_int(getattr(module, n, None)) for n in (*HEADS_ATTRS, *KV_HEADS_ATTRS)}
            self._cache["head_counts"] = {c for c in counts if c}
        return self._cache["head_counts"]

    def maps_heads(self, fqn: str) -> bool:
        """A leaf applying one matrix to each head's features alone (:mod:`hpgen.planner.derive.heads.maps`)."""
        return self.flow is not None and per_head_map(self.modules, fqn, self.flow) is not None

    def switched_off(self, name: str) -> bool:
        """An ``alibi`` input of a model whose config turns alibi off (Falcon's default): it arrives as None."""
        for attr in (name, f"use_{name}"):
            value = self.config(attr)
            if value is False:
                return True
        return False

    def is_attention(self, cols: AbstractSet[str], rows: AbstractSet[str]) -> bool:
        common = lca(cols | rows)
        name = type(self.modules[common]).__name__.lower() if common in self.modules else ""
        if "attn" in name or "attention" in name:
            return True
        return any(self._attr(p, HEAD_DIM_ATTRS) is not None for p in between(cols, common))

    def head_dim(self, cols: Iterable[str]) -> int | None:
        for path in between(cols, lca(cols)):
            value = self._attr(path, HEAD_DIM_ATTRS)
            if value is not None:
                return value
        value = positive_int(self.config("head_dim"))
        if value:
            return value
        hidden, heads = (positive_int(self.config(a)) for a in ("hidden_size", "num_attention_heads"))
        return hidden // heads if hidden and heads else None

    def query_kv_heads(self, cols: AbstractSet[str], rows: AbstractSet[str], layer: str) -> Heads | None:
        """(query heads, key/value heads, head_dim) of an attention group."""
        head_dim = self.head_dim(cols)
        if not head_dim:
            raise Refused("cannot tell the head size of the attention (no head_dim attribute or config value)")
        heads = None
        for path in between(cols, lca(cols | rows)):
            heads = heads or self._attr(path, HEADS_ATTRS)
        heads = heads or positive_int(self.config("num_attention_heads"))
        kv = None
        for path in between(cols, lca(cols | rows)):
            kv = kv or self._attr(path, KV_HEADS_ATTRS)
        if kv is None:
            kv = positive_int(self.config("num_key_value_heads")) or heads
        if not heads:
            raise Refused("cannot tell the number of attention heads")
        return Heads(heads, kv, head_dim)

    def _attr(self, path: str, names: Iterable[str]) -> int | None:
        module = self.modules.get(path)
        for name in names:
            value = positive_int(getattr(module, name, None)) if module is not None else None
            if value:
                return value
        return None

    def check_heads(
        self, cols: Iterable[str], layouts: Mapping[str, ColumnLayout], heads: Heads, layer: str
    ) -> None:
        """Refuse columns that do not hold whole heads, or whose heads (or groups) do not divide over ``--tp``."""
        q, kv, head_dim = heads
        tp = self.tp
        for col in sorted(cols):
            n = out_features(self.modules[col])
            layout = layouts[col]
            per_block = layout.block(n)
            if layout.in_blocks:  # multi-query [queries | key | value]: the query heads are cut, the rest is whole
                units = q
            elif layout.plain and n in (q, kv) and n % head_dim:
                units = n  # one value per head (a per-head gate)
            elif per_block % head_dim and not (layout.grouped and per_block % layout.count == 0):
                raise Refused(f"{relative(col, layer)} has {n} features, not a whole number of heads of {head_dim}")
            else:
                units = per_block // head_dim
            if layout.grouped:  # interleaved per head, per key/value group or per group of heads
                units = layout.count
            if tp is not None and units % tp:
                raise Refused(
                    f"{relative(col, layer)} holds {units} heads (or key/value groups, or groups of heads), which do "
                    f"not divide over --tp {tp}"
                )
        multi_query = any(layouts[col].in_blocks for col in cols)
        if tp is not None and (q % tp or (kv % tp and not multi_query)):
            raise Refused(f"{q} query and {kv} key/value heads do not divide over --tp {tp}")

    def shares(self, heads: Heads, where: str) -> HeadShares | None:
        """The heads' shares over ``--tp`` where they do not divide (None where they do, or without ``--tp``).

        Raises :class:`NoQueryHead` where a rank would hold no query head (the plan refuses that ``--tp`` when no
        other reason keeps the attention whole), :class:`Refused` where key/value heads fewer than the ranks do not
        divide them.
        """
        if self.tp is None:
            return None
        q, kv, head_dim = heads
        try:
            shares = head_shares(q, kv, head_dim, self.tp)
        except NoHeadForRank as error:
            raise NoQueryHead(f"{where}: {error}") from None
        except ValueError as error:
            raise Refused(str(error)) from None
        return None if shares.even else shares


def normalized_heads(module: Any, head_sizes: Iterable[int]) -> int | None:
    """The features a weightless ``nn.LayerNorm`` / ``nn.RMSNorm`` normalises together, when that is a whole
    number of heads (DiffLlama's ``groupnorm``, ``nn.RMSNorm(2 * head_dim, elementwise_affine=False)``).

    torch normalises each row of the trailing ``normalized_shape`` dims by itself, and the size is fixed
    at construction: a rank holding whole rows (the heads sharded on a dim before them) computes exactly
    its rows of the global result, and with no weight there is no gradient to reduce. A norm of another
    class (whose forward may reduce over anything) is not taken on trust.
    """
    import torch.nn as nn

    if not isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or any(True for _ in module.parameters()):
        return None
    shape = tuple(module.normalized_shape)
    if len(shape) != 1 or not isinstance(shape[0], int):
        return None
    return shape[0] if any(size and shape[0] % size == 0 for size in head_sizes) else None


def is_head_dim_name(attr: str) -> bool:
    """``head_dim``, ``attention_head_size``: the size of one head (never divided), not ``all_head_size``."""
    leaf = attr.rpartition(".")[2].lower()
    if leaf.startswith(("all_", "total_", "num_", "n_")):
        return False
    return leaf in HEAD_DIM_ATTRS or leaf.endswith(("head_dim", "head_size"))


def per_head_input(name: str) -> bool:
    lowered = name.lower()
    return any(part in lowered for part in PER_HEAD_INPUTS) and "mask" not in lowered


def _multi_query(attention: Any, n: int, head_dim: int) -> bool:
    """A fused multi-query projection (Falcon-7B's ``[all query heads | key | value]``), whose heads do not all cut
    alike: the query heads are sharded and the key and value kept whole (:func:`hpgen.planner.derive.column_layouts.query_blocks`)."""
    q, kv = (positive_int(getattr(attention, name, None)) for name in ("num_heads", "num_kv_heads"))
    return bool(q and kv and kv < q and n == (q + 2 * kv) * head_dim)
