"""Sequence-parallel rules (``--sp``): Megatron-style sequence parallelism on the ``tp`` axis.

Every decoder layer is listed by index (the first splits ``R -> S(1)`` at its input),
blocks gather ``S(1) -> R`` and reduce-scatter ``P(sum) -> S(1)``, a child of a layer
that mixes positions without being sharded (an MoE block around its experts, a recurrent
mixer) gathers and splits, norms on the shards get ``grad_reduce_params``, and the final
norm gathers at its output (when it is a class of the modeling file; otherwise the last
layer does), before the causal LM slices ``logits_to_keep`` and calls ``lm_head``.

A per-position tensor the model computes for the whole sequence and passes to every layer
(Gemma 4's ``per_layer_input``, ``[batch, sequence, ...]``) is split ``R -> S(1)`` at each
layer that computes with it on its sequence shard: in the layer's own body, or in a child
that does not gather (:func:`_per_position_arguments`). One handed only to children that
gather their input first (``position_embeddings``, a mask, to the attention) stays whole.
The same meta-device forward checks that the layers take the stream as ``[batch, positions,
...]``; another layout (Gemma 3n's AltUp stack ``[altup, batch, sequence, hidden]``) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from hpgen.core.errors import HpgenError
from hpgen.core.placement import REPLICATE, shard
from hpgen.core.plan_entries import Layout
from hpgen.planner.model.load import defined_in
from hpgen.planner.translate.boundary_record import Boundary, add_boundary
from hpgen.planner.translate.forwards import self_calls

if TYPE_CHECKING:
    from hpgen.planner.translate.plan_context import PlanContext

__all__ = ["has_params", "is_norm", "is_per_token", "sequence_parallel"]

# the tp axis: the residual stream replicated, sequence-sharded (dim 1), gathered
_R = Layout.same(("tp",), REPLICATE)
_SEQ = Layout.same(("tp",), shard(1))


def sequence_parallel(context: PlanContext, boundaries: dict[str, Boundary]) -> None:
    """Residual stream sharded on dim 1 between decoder layers (Megatron sequence parallel): adds the
    decoder layers, the children that gather, and the final norm to ``boundaries`` as ``sp`` boundaries."""
    forwards = context.forwards
    layers_path, layers = _decoder_layers(context, boundaries)
    count = len(layers)
    final_norm = _final_norm(context, layers_path)
    for index, (fqn, layer) in enumerate(layers):
        boundary = add_boundary(context, boundaries, fqn, "sp")
        first = index == 0
        last_gathers = index == count - 1 and final_norm is None
        boundary.inputs[forwards.first_input(layer, fqn)] = (_R if first else _SEQ, _SEQ)
        names = forwards.outputs(layer, fqn)
        boundary.out_names = names if len(names) > 1 else None
        boundary.outputs[names[0]] = (_SEQ, _R if last_gathers else _SEQ)
        boundary.axes.add("tp")
        for child_name, child in layer.named_children():
            child_fqn = f"{fqn}.{child_name}"
            inner = [b for key, b in boundaries.items() if key == child_fqn or key.startswith(child_fqn + ".")]
            own = child_fqn in boundaries and boundaries[child_fqn].kind in ("block", "experts")
            if own:
                boundaries[child_fqn].sp_input = True
            elif inner or (has_params(child) and not is_per_token(child)):
                wrapper = add_boundary(context, boundaries, child_fqn, "sp")
                wrapper.inputs[forwards.first_input(child, child_fqn)] = (_SEQ, _R)
                child_names = forwards.outputs(child, child_fqn)
                wrapper.out_names = child_names if len(child_names) > 1 else None
                wrapper.outputs[child_names[0]] = (_R, _SEQ)
            elif has_params(child):
                for param_name, _ in child.named_parameters():
                    boundary.grad_reduce.add(f"{child_name}.{param_name}")
        for param_name, _ in layer.named_parameters(recurse=False):
            boundary.grad_reduce.add(param_name)
    probe = _probe(context, layers)
    if probe is not None:
        _check_stream(context, layers, probe)
        for fqn, names in _per_position_arguments(context, boundaries, layers, probe).items():
            for name in names:
                boundaries[fqn].inputs[name] = (_R, _SEQ)  # the whole sequence's values, this rank's positions kept
    if final_norm is not None:
        fqn, norm = final_norm
        boundary = add_boundary(context, boundaries, fqn, "sp")
        boundary.inputs[forwards.first_input(norm, fqn)] = (_SEQ, _SEQ)
        names = forwards.outputs(norm, fqn)
        boundary.out_names = names if len(names) > 1 else None
        boundary.outputs[names[0]] = (_SEQ, _R)
        boundary.grad_reduce.update(name for name, _ in norm.named_parameters())
        boundary.axes.add("tp")


class _Probe(NamedTuple):
    """The decoder layers' arguments as one meta-device forward of ``batch`` sequences of ``length`` gave them:
    layer FQN -> argument name -> shape (None where not a tensor)."""

    batch: int
    length: int
    shapes: dict[str, dict[str, tuple[int, ...] | None]]

    def per_position(self, fqn: str, name: str) -> bool:
        """Whether the layer's argument holds one value per position: ``[batch, sequence, ...]``."""
        return tuple((self.shapes.get(fqn, {}).get(name) or ())[:2]) == (self.batch, self.length)


def _probe(context: PlanContext, layers: list[tuple[str, Any]]) -> _Probe | None:
    """The layers' argument shapes in one meta-device forward (:func:`~hpgen.planner.derive.heads.input_dims.
    recorded_arguments`) with a batch and a length no other size is mistaken for; None where the model does not
    run there (it is then taken as it is written)."""
    from hpgen.planner.derive.heads.input_dims import probe_sizes, recorded_arguments

    batch, length = probe_sizes(1)
    recorded = recorded_arguments(context.model, frozenset(type(layer) for _, layer in layers), batch, length)
    if isinstance(recorded, str):
        return None
    return _Probe(batch, length, {fqn: arguments for fqn, (arguments, _) in recorded.items()})


def _check_stream(context: PlanContext, layers: list[tuple[str, Any]], probe: _Probe) -> None:
    """Refuse a model whose layers take the residual stream with something else than the batch before the
    positions: ``S(1)`` would cut something else than the positions (Gemma 3n's AltUp stack ``[altup, batch,
    sequence, hidden]`` would be cut by batch). Positions need not be the input's length: CPM-Ant prepends its
    prompt, ProphetNet's n-gram streams join the main one."""
    for fqn, layer in layers:
        first = context.forwards.first_input(layer, fqn)
        shape = probe.shapes.get(fqn, {}).get(first)
        if shape is not None and (len(shape) < 3 or shape[0] != probe.batch):
            raise HpgenError(
                f"{context.name}: --sp shards the residual stream on dim 1, the positions, but {fqn} receives "
                f"{first} as {list(shape)} in a meta-device forward of batch {probe.batch} and length "
                f"{probe.length}: not [batch, positions, ...], so dim 1 is not the positions"
            )


def _per_position_arguments(
    context: PlanContext, boundaries: Mapping[str, Boundary], layers: list[tuple[str, Any]], probe: _Probe
) -> dict[str, tuple[str, ...]]:
    """Layer FQN -> the ``forward`` arguments, besides the residual stream, that it computes with on its sequence
    shard and that hold one value per position (``[batch, sequence, ...]`` in ``probe``).

    An argument the body hands, whole, only to children that gather the sequence first (a block of the plan, or
    a child wrapped to gather) is not computed with on the shard.
    """
    forwards = context.forwards
    found: dict[str, tuple[str, ...]] = {}
    for fqn, layer in layers:
        forward = forwards.owner(layer, fqn).forward
        if forward is None:
            continue
        # children the argument may reach whole: those that gather first, and names this layer does not have (a
        # branch of another layer type, Qwen3.5's self_attn in a linear-attention layer, never runs here)
        children = dict(layer.named_children())
        whole = {name for name in children if _gathers(boundaries.get(f"{fqn}.{name}"))}
        handed = {name: reads for name, reads in forward.handed_on}
        first = forwards.first_input(layer, fqn)
        per_position = tuple(
            parameter.name
            for parameter in forward.parameters[1:]
            if parameter.kind not in ("var_positional", "var_keyword")
            and parameter.name != first
            and not (
                parameter.name in handed
                and all(read.attr in whole or read.attr not in children for read in handed[parameter.name])
            )
            and probe.per_position(fqn, parameter.name)
        )
        if per_position:
            found[fqn] = per_position
    return found


def _gathers(boundary: Boundary | None) -> bool:
    """Whether a layer's child boundary gathers the sequence on entry (a block entered from the sharded stream,
    or a child wrapped to gather its input)."""
    if boundary is None:
        return False
    return boundary.sp_input or any(transition == (_SEQ, _R) for transition in boundary.inputs.values())


def _decoder_layers(context: PlanContext, boundaries: Mapping[str, Boundary]) -> tuple[str, list[tuple[str, Any]]]:
    """The ``nn.ModuleList`` holding the most boundaries: the decoder layers."""
    import torch.nn as nn

    best: tuple[int, str] | None = None
    for fqn, module in context.modules.items():
        if not isinstance(module, nn.ModuleList):
            continue
        held = sum(1 for key in boundaries if key.startswith(fqn + "."))
        if held and (best is None or held > best[0]):
            best = (held, fqn)
    if best is None:
        raise HpgenError(
            f"{context.name}: --sp: no decoder layer holds a sharded block (the plan shards "
            f"{', '.join(sorted(boundaries)) or 'nothing'}), so there is no all-reduce to split"
        )
    path = best[1]
    outside = [
        key for key, b in boundaries.items() if b.kind in ("block", "experts") and not key.startswith(path + ".")
    ]
    if outside:
        raise HpgenError(
            f"{context.name}: --sp: the sharded blocks {', '.join(outside)} are outside the decoder layers {path}"
        )
    return path, [(f"{path}.{name}", layer) for name, layer in context.modules[path].named_children()]


def _final_norm(context: PlanContext, layers_path: str) -> tuple[str, Any] | None:
    """The norm after the decoder layers, when it can gather the sequence at its output.

    It must be a class of the modeling file with a ``forward`` of its own, and the
    model's ``forward`` must call it once: a norm also applied before the layers
    (NanoChat) would gather a stream that is not sharded yet. Otherwise the last
    decoder layer gathers.
    """
    forwards = context.forwards
    parent_path = layers_path.rpartition(".")[0]
    parent = context.modules[parent_path]
    after = False
    for name, child in parent.named_children():
        fqn = f"{parent_path}.{name}" if parent_path else name
        if fqn == layers_path:
            after = True
            continue
        if after and is_norm(child):
            info = forwards.index.class_named(type(child).__name__)
            if info is None or info.forward is None or not defined_in(type(child), forwards.source):
                return None
            if self_calls(forwards.parsed, forwards.owner(parent, parent_path).name, name) != 1:
                return None
            return fqn, child
    return None


def is_norm(module: Any) -> bool:
    return "norm" in type(module).__name__.lower()


def is_per_token(module: Any) -> bool:
    """A layer that computes each position on its own (a norm, a linear map): it runs on sequence shards."""
    import torch.nn as nn

    return is_norm(module) or isinstance(module, nn.Linear)


def has_params(module: Any) -> bool:
    return any(True for _ in module.parameters())
