"""``hpgen plan --cp N``: context parallelism on a ``cp`` axis, alone or outside ``tp``.

Every rank of a ``cp`` group is given the whole batch. The plan cuts the sequence
(``R -> S(1)`` on ``cp``, which the runtime lays out head-tail for a balanced causal
load) where the decoder layers begin: the first layer's input and the rotary embedding's
``(cos, sin)``, so every layer rotates its tokens by their global positions. Each
attention module runs ``hpgen.runtime.context_attention.gathered_kv_attention`` (an injection): its
keys and values are all-gathered along the sequence and its queries keep their rows of
the whole sequence's mask. The final norm gathers the sequence back (``S(1) -> R``), so
the logits and the loss are the unsharded model's. Every parameter of the layers and
the norm computes on this rank's tokens only, so its gradient is summed over ``cp``:
``grad_reduce_params`` in its per-axis form, ``{"input_layernorm.weight": ["cp"]}``, plus
``tp`` for a parameter the tensor-parallel plan sums there (a norm under ``--sp``) and is
not sharded on (a parameter sharded on ``tp`` is summed over ``cp`` only).

With ``--tp`` the mesh is ``["cp", "tp"]`` (tp innermost): the tensor-parallel entries
get their ``cp`` placements added; with ``--sp`` too, tp shards each rank's cp tokens.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hpgen.core.context_coverage import CONTEXT_AXIS, GATHERED_KV_ATTENTION, context_refusal
from hpgen.core.errors import HpgenError
from hpgen.core.placement import REPLICATE, shard
from hpgen.core.plan_entries import Layout
from hpgen.core.plan_names import fqn_matches
from hpgen.planner.translate.draft import DraftEntry, DraftPlan, injection

__all__ = ["context_parallel"]
_SEQ = shard(1)


def context_parallel(model: Any, plan: DraftPlan | None, *, cp: int, name: str) -> DraftPlan:
    """``plan`` (a tensor-parallel draft, or ``None``) with the ``cp`` axis added outermost."""
    import torch.nn as nn

    from hpgen.planner.translate.forwards import Forwards

    if plan is not None and CONTEXT_AXIS in plan.mesh:
        raise HpgenError(f"{name}: --cp: the plan already has an axis named {CONTEXT_AXIS!r}")
    why = context_refusal(model.config)
    if why is not None:
        raise HpgenError(f"{name}: --cp: context parallelism does not cover {why}")
    forwards = Forwards(type(model), name)
    modules = dict(model.named_modules())
    layers_path = _decoder_layers(modules, nn, name)
    base_path = layers_path.rpartition(".")[0]
    rotary_path = _child(modules, base_path, lambda m: "rotary" in type(m).__name__.lower())
    if rotary_path is None:
        raise HpgenError(f"{name}: --cp: no rotary embedding next to {layers_path}: only rotary positions are cut")
    norm_path = _child(modules, base_path, lambda m: "norm" in type(m).__name__.lower())
    if norm_path is None:
        raise HpgenError(f"{name}: --cp: no final norm after {layers_path} to gather the sequence at")
    layers = [(f"{layers_path}.{child}", layer) for child, layer in modules[layers_path].named_children()]
    attention = _attention_name(layers[0][1], name)

    entries = dict(plan.entries) if plan is not None else {}
    mesh = (CONTEXT_AXIS, *(plan.mesh if plan is not None else ()))
    cut = {CONTEXT_AXIS: (REPLICATE, _SEQ)}
    kept = {CONTEXT_AXIS: (_SEQ, _SEQ)}
    gathered = {CONTEXT_AXIS: (_SEQ, REPLICATE)}

    cos_sin = forwards.outputs(modules[rotary_path], rotary_path)
    names = ("cos", "sin") if len(cos_sin) != 2 else cos_sin
    entries[rotary_path] = _merged(entries.get(rotary_path), outputs={n: cut for n in names}, out_names=names)
    for index, (fqn, layer) in enumerate(layers):
        first = forwards.first_input(layer, fqn)
        out = forwards.outputs(layer, fqn)
        params = tuple(param for param, _ in layer.named_parameters())
        entries[fqn] = _merged(
            entries.get(fqn),
            inputs={first: cut if index == 0 else kept},
            outputs={out[0]: kept},
            out_names=out if len(out) > 1 else None,
            grad_reduce=params,
            sharded=_sharded_params(entries, fqn),
        )
    pattern = f"{layers_path}.*.{attention}"
    attn = modules[f"{layers[0][0]}.{attention}"]
    attn_in = forwards.first_input(attn, f"{layers[0][0]}.{attention}")
    attn_out = forwards.outputs(attn, f"{layers[0][0]}.{attention}")
    entries[pattern] = _merged(
        entries.get(pattern),
        inputs={attn_in: kept},
        outputs={attn_out[0]: kept},
        out_names=attn_out if len(attn_out) > 1 else None,
    )
    norm = modules[norm_path]
    norm_out = forwards.outputs(norm, norm_path)
    entries[norm_path] = _merged(
        entries.get(norm_path),
        inputs={forwards.first_input(norm, norm_path): kept},
        outputs={norm_out[0]: gathered},
        out_names=norm_out if len(norm_out) > 1 else None,
        grad_reduce=tuple(param for param, _ in norm.named_parameters()),
        sharded=_sharded_params(entries, norm_path),
    )
    injections = (
        *(plan.injections if plan is not None else ()),
        injection(pattern, GATHERED_KV_ATTENTION, axis=CONTEXT_AXIS),
    )
    if plan is None:
        plan = DraftPlan(model_class=type(model).__name__, mesh=mesh, entries={})
    comments = {
        "context_parallel": (
            f"cp={cp}: the sequence is cut at {layers[0][0]} and {rotary_path} (head-tail chunks), "
            f"keys and values are all-gathered in {pattern}, and {norm_path} gathers it back"
        )
    }
    return plan.replace(mesh=mesh, entries=entries, injections=injections).with_comments(**comments)


def _decoder_layers(modules: dict[str, Any], nn: Any, name: str) -> str:
    """The largest ``nn.ModuleList``: the decoder layers."""
    lists = [(len(m), fqn) for fqn, m in modules.items() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise HpgenError(f"{name}: --cp: no decoder layers (an nn.ModuleList) to cut the sequence for")
    return max(lists)[1]


def _child(modules: dict[str, Any], parent: str, test: Any) -> str | None:
    prefix = f"{parent}." if parent else ""
    for fqn, module in modules.items():
        if fqn.startswith(prefix) and "." not in fqn[len(prefix) :] and test(module):
            return fqn
    return None


def _attention_name(layer: Any, name: str) -> str:
    found = [
        child
        for child, module in layer.named_children()
        if ("attn" in child or "attention" in child) and "norm" not in type(module).__name__.lower()
    ]
    if len(found) != 1:
        raise HpgenError(
            f"{name}: --cp: a decoder layer ({type(layer).__name__}) needs exactly one attention child, "
            f"found {', '.join(found) or 'none'}"
        )
    return found[0]


def _body_axes(entry: DraftEntry) -> tuple[str, ...]:
    """The axes ``entry``'s body computes on shards along (where a list of ``grad_reduce_params`` sums)."""
    layouts = (*entry.in_dst.values(), *entry.out_src.values(), *entry.params.values())
    found = dict.fromkeys(axis for layout in layouts for axis, placement in layout.placements if not placement.is_replicate)
    return tuple(found)


def _sharded_params(entries: dict[str, DraftEntry], fqn: str) -> dict[str, set[str]]:
    """The axes each parameter under ``fqn`` (by its path from there) is sharded on, from any entry."""
    depth = len(fqn.split("."))
    found: dict[str, set[str]] = {}
    for key, entry in entries.items():
        parts = key.split(".")
        if len(parts) < depth or not fqn_matches(".".join(parts[:depth]), fqn):
            continue
        prefix = ".".join(parts[depth:])
        for name, layout in entry.params.items():
            axes = {axis for axis, placement in layout.placements if not placement.is_replicate}
            if axes:
                found.setdefault(f"{prefix}.{name}" if prefix else name, set()).update(axes)
    return found


def _with(layouts: dict[str, Layout], moves: dict[str, dict[str, tuple[Any, Any]]], side: int) -> dict[str, Layout]:
    result = dict(layouts)
    for value, by_axis in moves.items():
        for axis, pair in by_axis.items():
            result[value] = result.get(value, Layout(())).with_axis(axis, pair[side])
    return result


def _merged(
    entry: DraftEntry | None,
    *,
    inputs: dict[str, Any] | None = None,
    outputs: dict[str, Any] | None = None,
    out_names: tuple[str, ...] | None = None,
    grad_reduce: tuple[str, ...] = (),
    sharded: dict[str, set[str]] | None = None,
) -> DraftEntry:
    """``entry`` (or a new one) with the ``cp`` placements of ``inputs``/``outputs`` ({value: {axis: (src, dst)}}).

    ``grad_reduce``: parameters whose gradients are summed over ``cp``; the entry's
    ``grad_reduce_params`` then name their axes, each with the other axes the entry's
    body is sharded on except those ``sharded`` (parameter -> axes) shards it on.
    """
    entry = entry or DraftEntry()
    inputs, outputs = inputs or {}, outputs or {}
    names = entry.out_names
    if out_names is not None and names is None:
        names = tuple(out_names)
    reduce = tuple(dict.fromkeys((*entry.grad_reduce_params, *grad_reduce)))
    axes = dict(entry.grad_reduce_axes)
    if grad_reduce:
        body = _body_axes(entry)
        for param in reduce:
            own = (sharded or {}).get(param, set())
            over = axes.get(param) or tuple(axis for axis in body if axis not in own)
            axes[param] = (CONTEXT_AXIS, *(axis for axis in over if axis != CONTEXT_AXIS))
    return replace(
        entry,
        grad_reduce_axes=axes,
        in_src=_with(dict(entry.in_src), inputs, 0),
        in_dst=_with(dict(entry.in_dst), inputs, 1),
        out_src=_with(dict(entry.out_src), outputs, 0),
        out_dst=_with(dict(entry.out_dst), outputs, 1),
        out_names=names,
        grad_reduce_params=reduce,
    )
