"""What a plan costs per rank, from the meta-device model: parameter bytes and collectives.

A user sizing a deployment wants the numbers before buying the GPUs. Everything here is
computed from the model built on the meta device (shapes only) and the plan:

- **parameters**: every parameter's bytes at the chosen dtype, each rank's share under
  its placement (``S`` splits like ``torch.tensor_split``, ``SS`` per packed block),
  tied parameters counted once; split into sharded and replicated;
- **collectives**: for every boundary the plan matches, the ops its contract lowers to
  (:func:`hpgen.core.decision.entry_decision`), forward and backward, each with the bytes of the
  tensor it moves per token (the value's feature width at that dtype) and the bytes a
  rank sends for it on a ring (all-reduce ``2 (p-1)/p``, all-gather and reduce-scatter
  ``(p-1)/p`` of the whole tensor). An all-gather that nothing tells its shard sizes
  first exchanges them (one int64 per rank), as :mod:`hpgen.runtime.forward.collectives` does;
  one after a split of the same dim, or of a wrapped module's features, does not. Gradient all-reduces of
  ``grad_reduce_params`` and of ``RS(d,r)`` parameters (over their ``r`` replicas) run once per backward,
  whatever the tokens.

Grouped per decoder layer (boundaries under a numbered module-list element, by layer
kind) and totalled per forward. torch is imported by the caller's model only; the
arithmetic here is plain Python.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpgen.core.decision import entry_decision
from hpgen.core.transitions import COMMUNICATING, DEFAULT_BACKWARD
from hpgen.core.model_config import config_value
from hpgen.core.plan import Plan, plan_from_dict
from hpgen.planner.model.modules import generic

__all__ = ["Collective", "HeadsHeld", "SizeReport", "format_bytes", "size_report"]

_DIGIT = re.compile(r"\.(\d+)(?=\.|$)")


@dataclass(frozen=True)
class Collective:
    """One collective a boundary runs per call: which, when, and the bytes per token."""

    module: str  # the boundary's FQN pattern (``model.layers.*.mlp``)
    value: str  # the input or output it moves
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all
    phase: str  # forward | backward
    tensor_bytes: int  # the whole tensor it produces or reduces, per token
    sent_bytes: float  # what one rank sends for it, per token (ring algorithm)
    calls: int  # collective calls per use


@dataclass(frozen=True)
class HeadsHeld:
    """The heads each rank holds of one attention, where they differ between ranks (heads that do not divide)."""

    heads: int
    query: tuple[int, ...]  # query heads per rank
    kv_heads: int
    kv: tuple[int, ...] | None  # key/value heads per rank (None where no projection of its own holds them)

    @property
    def busiest_share(self) -> float:
        """The most query heads a rank holds, as a share of all: its share of the attention's FLOPs (the score and
        value products are per query head), against ``1 / tp`` for an even cut."""
        return max(self.query) / self.heads

    def text(self) -> str:
        kv = f"; key/value heads {', '.join(map(str, self.kv))} of {self.kv_heads}" if self.kv is not None else ""
        return (
            f"query heads per rank {', '.join(map(str, self.query))} of {self.heads}{kv}; the busiest rank computes "
            f"{self.busiest_share:.3f} of the attention (even: {1 / len(self.query):.3f})"
        )


@dataclass
class SizeReport:
    """Parameter bytes per rank and collectives per forward/backward of one plan on ``tp`` ranks."""

    tp: int
    dtype: str
    element_size: int
    hidden_size: int | None
    dtype_from: str = ""  # why this dtype (the config's, --dtype), said beside it
    total_bytes: int = 0
    sharded_bytes: int = 0  # unsharded size of the parameters the plan shards
    replicated_bytes: int = 0
    rank_bytes: list[int] = field(default_factory=list)
    layers: dict[str, int] = field(default_factory=dict)  # layer pattern -> how many layers
    per_layer: dict[str, list[Collective]] = field(default_factory=dict)  # layer pattern -> its collectives
    outside: list[Collective] = field(default_factory=list)  # embedding, lm_head, final norm...
    grad_reduce_bytes: int = 0  # per backward: gradients of grad_reduce_params all-reduced
    grad_reduce_count: int = 0  # how many such all-reduces (one per parameter)
    optional: set[str] = field(default_factory=set)  # inputs defaulting to None: their collectives only when given
    heads: dict[str, HeadsHeld] = field(default_factory=dict)  # attention pattern -> its heads per rank, where uneven

    def totals(self, phase: str) -> dict[str, tuple[int, int, float]]:
        """kind -> (calls, tensor bytes, sent bytes) per token over a whole forward (or backward)."""
        found: dict[str, list[float]] = {}
        items = [(c, self.layers[p]) for p, cs in self.per_layer.items() for c in cs] + [(c, 1) for c in self.outside]
        for collective, times in items:
            if collective.phase != phase:
                continue
            entry = found.setdefault(collective.kind, [0, 0, 0.0])
            entry[0] += collective.calls * times
            entry[1] += collective.tensor_bytes * times
            entry[2] += collective.sent_bytes * times
        return {kind: (int(v[0]), int(v[1]), v[2]) for kind, v in sorted(found.items())}

    def size_exchanges(self) -> list[str]:
        """The gathers that exchange their shard sizes before each call (``hpgen explain`` says the same)."""
        found = [c for cs in (*self.per_layer.values(), self.outside) for c in cs if c.phase == "forward" and c.calls > 1]
        return sorted({f"{c.kind} of {c.value} at {c.module}" for c in found})

    def as_dict(self) -> dict[str, Any]:
        def rows(items: Iterable[Collective]) -> list[dict[str, Any]]:
            return [c.__dict__.copy() for c in items]

        return {
            "tp": self.tp,
            "dtype": self.dtype,
            "dtype_from": self.dtype_from,
            "parameters": {
                "total_bytes": self.total_bytes,
                "sharded_bytes": self.sharded_bytes,
                "replicated_bytes": self.replicated_bytes,
                "rank_bytes": list(self.rank_bytes),
            },
            "per_layer": {p: {"layers": self.layers[p], "collectives": rows(cs)} for p, cs in self.per_layer.items()},
            "outside_layers": rows(self.outside),
            "grad_reduce_bytes_per_backward": self.grad_reduce_bytes,
            "grad_reduce_calls_per_backward": self.grad_reduce_count,
            "per_token": {
                phase: {k: list(v) for k, v in self.totals(phase).items()} for phase in ("forward", "backward")
            },
            **({"heads": {p: h.__dict__.copy() for p, h in self.heads.items()}} if self.heads else {}),
        }

    def text(self) -> str:
        """The report as a few readable lines."""
        mb = format_bytes
        lines = [
            f"parameters at {self.dtype}{f' ({self.dtype_from})' if self.dtype_from else ''}: "
            f"{mb(self.total_bytes)} unsharded; per rank on --tp {self.tp}: "
            + ", ".join(f"rank {i} {mb(b)}" for i, b in enumerate(self.rank_bytes))
            + (f" ({max(self.rank_bytes) / self.total_bytes:.2f} of the model)" if self.total_bytes else ""),
            f"  sharded: {mb(self.sharded_bytes)} split over the ranks; replicated: {mb(self.replicated_bytes)} on "
            "every rank",
        ]
        for pattern, held in self.heads.items():  # only where the heads do not divide: ranks hold different counts
            lines.append(f"  {pattern}: {held.text()}")
        width = f"hidden size {self.hidden_size}, " if self.hidden_size else ""
        lines.append(f"collectives per token ({width}{self.dtype}; they grow with the tokens of a batch):")
        for pattern, collectives in self.per_layer.items():
            lines.append(f"  each of {self.layers[pattern]} decoder layers {pattern}:")
            lines += _describe(collectives, "    ")
        if self.outside:
            lines.append("  outside the decoder layers:")
            lines += _describe(self.outside, "    ")
        for phase in ("forward", "backward"):
            totals = self.totals(phase)
            if totals:
                parts = [
                    f"{calls} {kind} ({mb(tensor)}, {mb(sent)} sent per rank)"
                    for kind, (calls, tensor, sent) in totals.items()
                ]
                lines.append(f"  total per {phase}: " + "; ".join(parts))
        exchanging = self.size_exchanges()
        if exchanging:
            lines.append(
                "  gathers that exchange their shard sizes first (nothing earlier in the forward records them: no "
                "wrapped layer's full size, no split of that dim), one more all-gather of an int64 per rank each "
                "call, counted above: " + "; ".join(exchanging)
            )
        if self.optional:
            lines.append(
                "  not counted: the inputs "
                + ", ".join(sorted(self.optional))
                + " default to None (encoder states for cross-attention, per-layer inputs) and add their "
                "collectives only when given"
            )
        if self.grad_reduce_bytes:
            lines.append(
                f"  plus, once per backward: gradient all-reduces of replicated parameters, {mb(self.grad_reduce_bytes)}"
            )
        return "\n".join(lines)


def _describe(collectives: Iterable[Collective], indent: str) -> list[str]:
    lines = []
    for c in collectives:
        lines.append(
            f"{indent}{c.phase:8} {c.kind} of {c.value} at {c.module}: {format_bytes(c.tensor_bytes)} per token, "
            f"{format_bytes(c.sent_bytes)} sent per rank"
        )
    return lines


def format_bytes(count: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


# --------------------------------------------------------------------------- computing it


def size_report(
    model: Any, plan: Mapping[str, Any] | Plan, *, tp: int, dtype: Any = None, dtype_from: str = ""
) -> SizeReport:
    """The report of ``plan`` on ``tp`` ranks for ``model`` (any device: only shapes are read);
    ``dtype_from`` says why ``dtype`` (printed beside it)."""
    import torch

    from hpgen.core.placement import Placement
    from hpgen.core.shards import ShardLayout

    loaded = plan if isinstance(plan, Plan) else plan_from_dict(plan)
    dtype = _dtype(dtype, model)
    element = torch.empty((), dtype=dtype).element_size()
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    report = SizeReport(
        tp, str(dtype).replace("torch.", ""), element, hidden if isinstance(hidden, int) else None, dtype_from
    )
    modules = dict(model.named_modules())
    matched = {fqn: loaded.entry_for(fqn) for fqn in modules if fqn}
    matched = {fqn: entry for fqn, entry in matched.items() if entry is not None}

    # parameters: each Parameter once, with the placement of the entry that plans it
    layouts: dict[int, Placement] = {}
    for fqn, entry in matched.items():
        for name, layout in entry.params.items():
            try:
                param = modules[fqn].get_parameter(name)
            except AttributeError:
                continue
            layouts[id(param)] = layout.on("tp")
    report.rank_bytes = [0] * tp
    seen: set[int] = set()
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        size = param.numel() * element
        report.total_bytes += size
        placement = layouts.get(id(param))
        if placement is None or placement.is_replicate:
            report.replicated_bytes += size
            for rank in range(tp):
                report.rank_bytes[rank] += size
            continue
        report.sharded_bytes += size
        for rank in range(tp):
            shape = ShardLayout(tuple(param.shape), ((placement, rank, tp),)).local_shape
            report.rank_bytes[rank] += _prod(shape) * element

    report.heads = _heads_held(modules, matched, text, tp)

    # collectives: per boundary instance, grouped by decoder layer kind
    layer_members: dict[str, dict[str, list[Collective]]] = {}
    for fqn, entry in sorted(matched.items(), key=lambda item: _natural(item[0])):
        if not entry.is_boundary:
            continue
        collectives = _collectives(loaded, entry, fqn, modules[fqn], element, hidden, report.optional)
        for name in entry.grad_reduce_params:
            try:
                report.grad_reduce_bytes += modules[fqn].get_parameter(name).numel() * element
                report.grad_reduce_count += 1
            except AttributeError:
                continue
        for name, layout in sorted(entry.params.items()):  # RS(d,r): the local chunk summed over its r replicas
            placement = layout.on("tp")
            replicated = _replicated_rows(placement, tp)  # B(d, ...): the rows of its R and RS blocks
            if (placement.kind != "RS" or placement.replicas < 2) and not replicated:
                continue
            if name in entry.grad_reduce_params:
                continue
            try:
                param = modules[fqn].get_parameter(name)
            except AttributeError:
                continue
            if replicated:
                report.grad_reduce_bytes += replicated * _prod(param.shape) // param.shape[placement.dim] * element
            else:
                local = ShardLayout(tuple(param.shape), ((placement, 0, tp),)).local_shape
                report.grad_reduce_bytes += _prod(local) * element
            report.grad_reduce_count += 1
        layer = _layer_of(fqn)
        if layer is None:
            report.outside += collectives
        else:
            layer_members.setdefault(layer, {})[fqn] = collectives
    kinds: dict[tuple, str] = {}
    for layer, members in layer_members.items():
        signature = tuple(
            (_relative_pattern(fqn, layer), c.value, c.kind, c.phase, c.tensor_bytes)
            for fqn, cs in members.items()
            for c in cs
        )
        pattern = kinds.setdefault(signature, generic(layer))
        report.layers[pattern] = report.layers.get(pattern, 0) + 1
        if pattern not in report.per_layer:
            report.per_layer[pattern] = [
                Collective(generic(c.module), c.value, c.kind, c.phase, c.tensor_bytes, c.sent_bytes, c.calls)
                for cs in members.values()
                for c in cs
            ]
    return _ring(report)


def _collectives(
    plan: Plan, entry: Any, fqn: str, module: Any, element: int, hidden: Any, optional: set[str]
) -> list[Collective]:
    import inspect

    import torch.nn as nn

    from hpgen.generator.explain import made_shards, sizes_note

    made = made_shards(plan)
    wrapped = isinstance(module, (nn.Linear, nn.Embedding))
    decision = entry_decision(plan, entry.key, known_inputs=("input",) if isinstance(module, nn.Linear) else ())
    inputs, outputs = decision.inputs, decision.outputs
    try:
        signature = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        signature = {}
    found: list[Collective] = []
    for side, values in (("in", inputs), ("out", outputs)):
        for value in values:
            parameter = signature.get(value.name) if side == "in" else None
            if parameter is not None and parameter.default is None and not wrapped:
                optional.add(value.name)
                continue
            width = _width(module, value.name, side, entry, hidden, wrapped)
            for op in value.ops:
                if op.axis != "tp" or op.is_identity:
                    continue
                forward = op.kind if op.kind in COMMUNICATING else None
                backward = op.backward or DEFAULT_BACKWARD.get(op.kind)
                # A forward gather exchanges shard sizes only where nothing tells it them (hpgen explain
                # says which); backward ops reuse what their forward learnt.
                note = sizes_note(op, made, features=wrapped) if op.kind in ("all_gather", "all_to_all") else None
                exchanges = note is not None and note.startswith("exchanged")
                for phase, kind in (("forward", forward), ("backward", backward)):
                    if kind is None or kind not in COMMUNICATING:
                        continue
                    calls = 2 if phase == "forward" and exchanges else 1
                    found.append(Collective(generic(fqn), value.name, kind, phase, width * element, 0.0, calls))
    summed = decision.summed
    if summed is not None and summed.axis == "tp" and isinstance(hidden, int):
        # the block's one reduction of both branches, and its shared input's transition (on the stream's width)
        # (a paired second norm's output travels with the shared input's, concatenated: twice the width)
        moved = 2 if summed.paired_input else 1
        for op, width in ((summed.reduce, 1), (summed.shared, moved)):
            if op is None:
                continue
            for phase, kind in (("forward", op.kind), ("backward", op.backward or DEFAULT_BACKWARD.get(op.kind))):
                if kind in COMMUNICATING:
                    found.append(Collective(generic(fqn), op.name, kind, phase, width * hidden * element, 0.0, 1))
    return found


def _config_int(config: Any, name: str) -> int | None:
    """An integer config value; None where it is absent or differs per layer (transformers raises then)."""
    value = config_value(config, name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _replicated_rows(placement: Any, tp: int) -> int:
    """The rows of a ``B`` placement's blocks held by more than one rank (``R``, ``RS``) that a rank holds: their
    gradient is summed over the holders once per backward (multi-query Falcon's key and value)."""
    from hpgen.core.shards import ShardLayout

    if placement.kind != "B":
        return 0
    rows = 0
    for size, inner in placement.parts:
        if inner.is_replicate:
            rows += size
        elif inner.kind == "RS" and inner.replicas > 1:
            rows += ShardLayout((size,), ((inner.on_dim(0), 0, tp),)).local_shape[0]
    return rows


def _heads_held(modules: Mapping[str, Any], matched: Mapping[str, Any], config: Any, tp: int) -> dict[str, HeadsHeld]:
    """Each attention's heads per rank, by pattern, where they differ between ranks.

    The query heads are read from the projection whose input is all of them (``o_proj``: its input features cut in
    whole heads), the key/value heads from a projection whose output is theirs alone.
    """
    from hpgen.core.shards import ShardLayout

    heads, kv = (_config_int(config, name) for name in ("num_attention_heads", "num_key_value_heads"))
    kv = kv or heads
    if not isinstance(heads, int) or not isinstance(kv, int) or heads < 1:
        return {}
    found: dict[str, HeadsHeld] = {}
    for fqn, entry in matched.items():
        module = modules[fqn]
        head_dim = getattr(module, "head_dim", None) or _config_int(config, "head_dim")
        hidden = _config_int(config, "hidden_size")
        head_dim = head_dim or (hidden // heads if isinstance(hidden, int) else None)
        name = f"{type(module).__name__} {fqn}".lower()  # the attention, or its row projection as an entry of its own
        if not isinstance(head_dim, int) or head_dim < 1 or not ("attn" in name or "attention" in name):
            continue
        query = keys = None
        for param_name, layout in sorted(entry.params.items()):
            placement = layout.on("tp")
            found_param = _param_and_owner(module, param_name)
            if found_param is None:
                continue
            param, owner = found_param
            if param.dim() != 2 or placement.is_replicate:
                continue
            transposed = type(owner).__name__ == "Conv1D"
            inputs, outputs = (0, 1) if transposed else (1, 0)
            dim = placement.dim % 2 if placement.dim is not None else None
            local = [ShardLayout(tuple(param.shape), ((placement, r, tp),)).local_shape for r in range(tp)]
            if dim is not None and any(shape[dim] % head_dim for shape in local):
                continue  # not cut in whole heads (a projection of other features)
            if dim == inputs and param.shape[inputs] == heads * head_dim and query is None:
                query = tuple(shape[inputs] // head_dim for shape in local)
            elif dim == outputs and param.shape[outputs] == kv * head_dim and kv != heads and keys is None:
                keys = tuple(shape[outputs] // head_dim for shape in local)
        if query is not None and (len(set(query)) > 1 or (keys is not None and len(set(keys)) > 1)):
            found.setdefault(generic(fqn), HeadsHeld(heads, query, kv, keys))
    return found


def _param_and_owner(module: Any, param_name: str) -> tuple[Any, Any] | None:
    """The parameter ``param_name`` of ``module`` and the submodule that holds it, or None
    where the entry names a parameter the module does not have."""
    try:
        param = module.get_parameter(param_name)
    except AttributeError:
        return None
    owner = module.get_submodule(param_name.rpartition(".")[0]) if "." in param_name else module
    return param, owner


def _width(module: Any, name: str, side: str, entry: Any, hidden: Any, wrapped: bool) -> int:
    """Features per token of one boundary value (the whole tensor, unsharded)."""
    import torch.nn as nn

    if isinstance(module, nn.Linear):
        return module.in_features if side == "in" else module.out_features
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    # a block: inputs come in at the width the column weights read (or, where replicated down-projections
    # come first, as MLA's latent ones, the width those read), outputs at the rows' width; the
    # stream's width first where a weight reads it (a Mamba mixer's dt_proj reads a few values, not the stream)
    if side == "in":
        for param_name in sorted(entry.grad_reduce_params):
            found_param = _param_and_owner(module, param_name)
            if found_param is None:
                continue
            param, owner = found_param
            if param.dim() == 2 and isinstance(owner, nn.Linear):
                return int(owner.in_features)
    widths: list[int] = []
    for param_name, layout in sorted(entry.params.items()):
        placement = layout.on("tp")
        found_param = _param_and_owner(module, param_name)
        if found_param is None:
            continue
        param, owner = found_param
        if param.dim() != 2 or placement.kind not in ("S", "SS"):
            continue
        transposed = type(owner).__name__ == "Conv1D"
        rows, cols = (param.shape[1], param.shape[0]) if transposed else (param.shape[0], param.shape[1])
        dim = placement.dim % 2
        column = (dim == 0) != transposed  # output features sharded
        if not isinstance(owner, nn.Linear) and not transposed:
            continue  # a parameter the body reads itself (A_log), not a projection
        if side == "in" and column:
            widths.append(int(cols))
        if side == "out" and not column:
            widths.append(int(rows))
    if isinstance(hidden, int) and hidden in widths:
        return hidden
    if widths:
        return widths[0]
    return int(hidden) if isinstance(hidden, int) else 0


def _ring(report: SizeReport) -> SizeReport:
    """Fill in the bytes each rank sends on a ring of ``report.tp`` ranks."""
    p = report.tp
    factor = {
        "all_reduce": 2 * (p - 1) / p,
        "all_gather": (p - 1) / p,
        "reduce_scatter": (p - 1) / p,
        "all_to_all": (p - 1) / p,
    }

    def fix(items: list[Collective]) -> list[Collective]:
        return [
            Collective(c.module, c.value, c.kind, c.phase, c.tensor_bytes, c.tensor_bytes * factor[c.kind], c.calls)
            for c in items
        ]

    report.per_layer = {k: fix(v) for k, v in report.per_layer.items()}
    report.outside = fix(report.outside)
    return report


def _dtype(dtype: Any, model: Any) -> Any:
    import torch

    if dtype is None:
        first = next(iter(model.parameters()), None)
        return first.dtype if first is not None else torch.float32
    if isinstance(dtype, str):
        value = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r} (bfloat16, float16, float32, ...)")
        return value
    return dtype


def _prod(shape: Iterable[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _layer_of(fqn: str) -> str | None:
    """``model.layers.3.mlp`` -> ``model.layers.3`` (the numbered module-list element), else None."""
    match = list(_DIGIT.finditer(fqn))
    return fqn[: match[0].end()] if match else None


def _relative_pattern(fqn: str, layer: str) -> str:
    return fqn[len(layer) + 1 :] if fqn.startswith(layer + ".") else ""


def _natural(fqn: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in fqn.split(".")]
