"""Where a parallel model first departs from the unsharded one: hooks on both, values compared gathered.

A :class:`Recorder` on each model records, in execution order, the output of every module
that lies outside every boundary's body (the boundaries themselves, the decoder layers
around them, the norms between them), the gradient of each of their tensor inputs in the
backward, the order the parameters' gradients are produced in, and which module was running
when a forward raised. :func:`first_difference` then walks the sharded model's records and
compares each with the reference's at the same point, the sharded value in its gathered
form: a partial output (``out_dst`` ``P``) reduced over its axis, a dim shorter than the
reference's gathered over the axis whose shards add up to it (uneven shards included; on
the ``cp`` axis, whose ranks each hold two chunks of the sequence, put back in sequence
order, so each rank's part is compared with that part of the reference).

Every rank walks the same records in the same order, so the collectives line up. Inside a
boundary's body values are per-rank pieces whose layout the plan does not state; they are
not compared (a difference there shows at the boundary's output).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpgen.core.context_coverage import CONTEXT_AXIS

__all__ = ["Difference", "Recorder", "first_difference", "returned_as_declared", "tolerance"]


def tolerance(reference: torch.Tensor) -> float:
    """1e-5 absolute plus 1e-4 of the reference's scale (its max abs), as hpgen's parity tests use."""
    return 1e-5 + 1e-4 * reference.detach().abs().max().item() if reference.numel() else 1e-5


@dataclass(frozen=True)
class Difference:
    """A value of the sharded model that differs from the reference's at the same point."""

    fqn: str
    cls: str
    side: str  # "forward" (an output) or "backward" (an input's gradient, or a parameter's)
    what: str  # the output's or input's name (``output``, ``attn_output``, ``hidden_states``, a parameter)
    err: float
    tol: float


@dataclass
class Record:
    fqn: str
    what: str
    value: torch.Tensor


class Recorder:
    """Hooks on one model: outputs and input gradients of the watched modules, the running module."""

    def __init__(self, model: nn.Module, plan: Any, *, params: bool = False) -> None:
        self.plan = plan
        self.outputs: list[Record] = []
        self.grads: list[Record] = []
        self.param_order: list[str] = []
        self.stack: list[str] = []
        self.classes = {fqn: type(module).__name__ for fqn, module in model.named_modules()}
        self._handles: list[Any] = []
        self._calls: dict[str, int] = {}
        self.watched = watched_modules(model, plan)
        for fqn, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter(fqn), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._leave(fqn)))
        if params:
            for name, param in model.named_parameters():
                if param.requires_grad:
                    self._handles.append(param.register_hook(self._param_done(name)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def clear(self) -> None:
        self.outputs.clear()
        self.grads.clear()
        self.param_order.clear()
        self.stack.clear()
        self._calls.clear()

    def _enter(self, fqn: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.stack.append(fqn)
            if fqn not in self.watched:
                return
            call = self._calls.get(fqn, 0)
            self._calls[fqn] = call + 1
            names = _argument_names(module, len(args))
            for name, value in [*zip(names, args), *kwargs.items()]:
                if isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point():
                    value.register_hook(self._grad_done(fqn, f"{name}#{call}"))

        return hook

    def _leave(self, fqn: str) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self.stack and self.stack[-1] == fqn:
                self.stack.pop()
            if fqn not in self.watched:
                return
            call = self._calls.get(fqn, 1) - 1
            names = _output_names(self.plan.entry_for(fqn))
            for index, tensor in _tensors(output):
                name = names[index] if index is not None and index < len(names) else f"output[{index}]"
                if index is None:
                    name = names[0] if names else "output"
                self.outputs.append(Record(fqn, f"{name}#{call}", tensor.detach().clone()))

        return hook

    def _grad_done(self, fqn: str, what: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self.grads.append(Record(fqn, what, grad.detach().clone()))

        return hook

    def _param_done(self, name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self.param_order.append(name)

        return hook


def watched_modules(model: nn.Module, plan: Any) -> set[str]:
    """FQNs of the modules outside every boundary's body (a boundary itself included)."""
    inside: set[str] = set()
    watched: set[str] = set()
    for fqn, _ in model.named_modules():
        if not fqn:
            continue
        if any(fqn.startswith(body + ".") for body in inside):
            continue
        watched.add(fqn)
        entry = plan.entry_for(fqn)
        if entry is not None and entry.is_boundary:
            inside.add(fqn)
    return watched


def _argument_names(module: nn.Module, count: int) -> list[str]:
    import inspect

    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return [f"arg{i}" for i in range(count)]
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [names[i] if i < len(names) else f"arg{i}" for i in range(count)]


def _output_names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return entry.output_names


def _tensors(output: Any) -> Iterator[tuple[int | None, torch.Tensor]]:
    """The floating-point tensors of a module's output: the value itself, or a tuple's items by index."""
    if isinstance(output, torch.Tensor):
        if output.is_floating_point():
            yield None, output
        return
    if isinstance(output, (tuple, list)):
        for index, item in enumerate(output):
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                yield index, item
        return
    first = getattr(output, "last_hidden_state", None)
    if first is None:
        first = getattr(output, "logits", None)
    if isinstance(first, torch.Tensor) and first.is_floating_point():
        yield 0, first


# --------------------------------------------------------------------------- comparison on ranks


def first_difference(
    mine: list[Record], reference: list[Record], side: str, classes: dict[str, str], plan: Any, mesh: Any
) -> Difference | None:
    """The first of ``mine`` (execution order) whose gathered value differs from the reference's record."""
    by_point = {(record.fqn, record.what): record.value for record in reference}
    found = None
    for record in mine:
        ref = by_point.get((record.fqn, record.what))
        if ref is None:
            continue
        declared = _declared_shards(plan, record, side)
        value = gathered(record.value, ref, _partial_axes(plan, record, side), mesh, declared)
        if found is not None:
            continue  # every rank still takes part in every record's collectives
        name = record.what.split("#")[0]
        if value is _MISSHAPEN:
            shape = tuple(record.value.shape)
            found = Difference(record.fqn, classes.get(record.fqn, "?"), side,
                               f"{name} (shape {shape} on this rank, {tuple(ref.shape)} unsharded)", float("inf"), 0.0)
            continue
        if value is None:
            continue
        err = (value.float() - ref.float()).abs().max().item() if value.numel() else 0.0
        tol = tolerance(ref)
        if not err <= tol:
            found = Difference(record.fqn, classes.get(record.fqn, "?"), side, name, err, tol)
    return found


def returned_as_declared(
    mine: list[Record], returned: torch.Tensor, reference: torch.Tensor, classes: dict[str, str], plan: Any
) -> Difference | None:
    """The boundary whose output the model returns as it is, when that output is declared sharded
    or partial (``out_dst`` ``S``/``P``): right by its own entry, so :func:`first_difference` passes
    it, but the model's output must be whole (an ``lm_head`` whose gather was left out)."""
    for record in reversed(mine):
        entry = plan.entry_for(record.fqn)
        if entry is None or not entry.is_boundary:
            continue
        if record.value.shape != returned.shape or not torch.equal(record.value, returned.detach()):
            continue
        name = record.what.split("#")[0]
        layout = entry.out_dst.get(name)
        if layout is None or not any(p.is_shard or p.is_partial for _, p in layout.placements):
            return None
        declared = ", ".join(f"{axis} {placement}" for axis, placement in layout.placements)
        return Difference(
            record.fqn, classes.get(record.fqn, "?"), "forward",
            f"{name} (declared {declared} and returned by the model as it is: shape {tuple(returned.shape)} on "
            f"this rank, {tuple(reference.shape)} unsharded)", float("inf"), 0.0,
        )
    return None


_MISSHAPEN = torch.empty(0)  # a boundary's output whose declared layout does not explain its shape


def _declared_shards(plan: Any, record: Record, side: str) -> set[tuple[str, int]] | None:
    """(axis, dim) a boundary's output is declared sharded on (``out_dst`` ``S``); None off boundaries."""
    if side != "forward":
        return None
    entry = plan.entry_for(record.fqn)
    if entry is None or not entry.is_boundary:
        return None
    layout = entry.out_dst.get(record.what.split("#")[0])
    if layout is None:
        return set()
    return {(axis, placement.dim) for axis, placement in layout.placements if placement.is_shard}


def _partial_axes(plan: Any, record: Record, side: str) -> list[tuple[str, str]]:
    """(axis, op) of an output the plan leaves partial for its caller (``out_dst`` ``P``)."""
    if side != "forward":
        return []
    entry = plan.entry_for(record.fqn)
    if entry is None:
        return []
    name = record.what.split("#")[0]
    layout = entry.out_dst.get(name)
    if layout is None:
        return []
    return [(axis, placement.op) for axis, placement in layout.placements if placement.is_partial]


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.SUM}


def gathered(
    local: torch.Tensor, ref: torch.Tensor, partial: list[tuple[str, str]], mesh: Any,
    declared: set[tuple[str, int]] | None = None,
) -> torch.Tensor | None:
    """``local`` in its full form to compare with ``ref``; None where no gather makes the shapes agree.

    ``declared``: the (axis, dim) a boundary's output is declared sharded on; a shape its
    layout does not explain gives :data:`_MISSHAPEN`. Off boundaries (None) any axis whose
    shards add up to the reference's size is gathered; on a boundary, a dim declared sharded
    on several axes is gathered over each, the innermost first.
    """
    value = local.detach().float().contiguous()
    for axis, op in partial:
        group = mesh.get_group(axis)
        dist.all_reduce(value, op=_OPS[op], group=group)
        if op == "avg":
            value = value / dist.get_world_size(group)
    # every rank's shape, so that every rank takes the same decision
    shape = torch.full((8,), -1, dtype=torch.int64)
    shape[: value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
    shapes = [torch.empty_like(shape) for _ in range(dist.get_world_size())]
    dist.all_gather(shapes, shape)
    table = torch.stack(shapes)
    misshapen = None if declared is None else _MISSHAPEN
    if any(int((row >= 0).sum()) != ref.dim() for row in table):
        return misshapen
    mismatched = [d for d in range(ref.dim()) if any(int(row[d]) != ref.shape[d] for row in table)]
    if not mismatched:
        return value
    if len(mismatched) != 1:
        return misshapen
    dim = mismatched[0]
    for axis in mesh.mesh_dim_names:
        if declared is not None and not any(a == axis and d % ref.dim() == dim for a, d in declared):
            continue
        group = mesh.get_group(axis)
        members = dist.get_process_group_ranks(group)
        # the groups of one axis are alike: every rank tests its own and all agree
        sizes = [int(table[member][dim]) for member in members]
        if sum(sizes) != ref.shape[dim]:
            continue
        whole = _gather_uneven(value, dim, sizes, group)
        if axis == CONTEXT_AXIS:  # each rank holds two chunks (head-tail): put them back in sequence order
            from hpgen.runtime.forward.context_axis import HeadTail

            whole = whole.index_select(dim, HeadTail(whole.size(dim), len(sizes), 0, whole.device).restore)
        return whole
    # a boundary's dim declared sharded on several axes (cp x tp with --sp: cp cuts the sequence, tp each
    # cp rank's tokens): gather the innermost of them, then the rest (every rank takes the same branch)
    axes = [axis for axis in mesh.mesh_dim_names if any(a == axis and d % ref.dim() == dim for a, d in declared or ())]
    if len(axes) > 1:
        group = mesh.get_group(axes[-1])
        sizes = [int(table[member][dim]) for member in dist.get_process_group_ranks(group)]
        inner = _gather_uneven(value, dim, sizes, group)
        return gathered(inner, ref, [], mesh, {(a, d) for a, d in declared if a != axes[-1]})
    return misshapen


def _gather_uneven(value: torch.Tensor, dim: int, sizes: list[int], group: Any) -> torch.Tensor:
    """All-gather shards of ``dim`` whose sizes may differ by rank (padded, gathered, trimmed)."""
    largest = max(sizes)
    pad = list(value.shape)
    pad[dim] = largest - value.shape[dim]
    padded = torch.cat([value, value.new_zeros(pad)], dim) if pad[dim] else value
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([piece.narrow(dim, 0, size) for piece, size in zip(pieces, sizes)], dim)
