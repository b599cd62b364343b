"""Local compute functions for region boundaries (``injections[].local_compute_fn``).

A region boundary's generated ``forward`` moves the inputs, calls
``self.__hp_compute__(...)`` and moves the outputs; ``parallelize`` binds
``__hp_compute__`` to ``functools.partial(fn, module, **kwargs)`` with ``fn`` and
``kwargs`` from the plan's injection, e.g.::

    {"match": "model.layers.*.mlp.experts",
     "local_compute_fn": {"_target_": "hpgen.runtime.local.experts_parallel", "axis": "ep"}}
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["experts_parallel", "local_experts"]


def local_experts(module: nn.Module, axis: str) -> tuple[int, int]:
    """``(first, count)``: the global ids of the experts this rank holds on ``axis``.

    ``parallelize`` has sharded the expert parameters on dim 0 and refused an expert count
    that does not divide, so rank ``r`` of ``k`` holds ``[r * E / k, (r + 1) * E / k)``.
    """
    count = module.gate_up_proj.shape[0]
    ax = getattr(module, f"_hp_{axis}")
    if count * ax.size != module.num_experts:
        raise ValueError(
            f"{type(module).__name__}: {count} local experts x {ax.size} ranks of axis {axis!r} "
            f"is not num_experts={module.num_experts}; were the experts sharded on dim 0 over {axis!r}?"
        )
    return ax.rank * count, count


def experts_parallel(
    module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *, axis: str = "ep"
) -> Tensor:
    """Expert parallelism for transformers' 3-D experts (``Qwen3MoeExperts``, ``MixtralExperts``, ...).

    The module holds ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``,
    sharded on dim 0 by ``parallelize``: this rank holds experts ``[first, first + count)``
    of axis ``axis`` (see :func:`local_experts`). ``hidden_states`` is ``[tokens, H]``
    (replicated), ``top_k_index`` and ``top_k_weights`` are ``[tokens, top_k]`` with the
    routed global expert ids (the value ``num_experts`` means "no expert"). Ids of other
    ranks' experts go to the local sentinel ``count``, and only local experts run, with the
    math of the class's eager ``forward``: ``gate, up = linear(x, gate_up[e]).chunk(2)``,
    ``act_fn(gate) * up``, ``linear(., down[e])``, times the routing weight, ``index_add_``.

    The result is this rank's partial sum (``P(sum)``) over ``axis``; the generated
    ``forward``'s output op all-reduces it. Without ``parallelize`` (axis of size 1) it
    computes the whole layer.

    transformers' ``@use_experts_implementation`` decorator dispatches the class's
    ``forward`` on ``config._experts_implementation``; only ``"eager"`` runs the generated
    ``forward`` (and so this function). Build the model with
    ``experts_implementation="eager"`` (a config or ``from_pretrained`` keyword), or call
    ``model.set_experts_implementation("eager")``.
    """
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        raise NotImplementedError(
            f"experts_parallel: {type(module).__name__} stores transposed weights or biases; "
            "only the [E, 2I, H] / [E, H, I] layout without bias is supported"
        )
    if not getattr(module, "has_gate", True) or not getattr(module, "is_concatenated", True):
        raise NotImplementedError(
            f"experts_parallel: {type(module).__name__} has no concatenated gate_up_proj; not supported"
        )
    first, count = local_experts(module, axis)
    mine = (top_k_index >= first) & (top_k_index < first + count)
    local_index = torch.where(mine, top_k_index - first, torch.full_like(top_k_index, count))

    output = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(local_index, num_classes=count + 1).permute(2, 1, 0)  # [count + 1, top_k, tokens]
        expert_hit = torch.greater(expert_mask[:count].sum(dim=(-1, -2)), 0).nonzero()
    apply_gate = getattr(module, "_apply_gate", None)
    for expert in expert_hit:
        expert = expert[0]
        top_k_pos, token_idx = torch.where(expert_mask[expert])
        gate_up = F.linear(hidden_states[token_idx], module.gate_up_proj[expert])
        if apply_gate is not None:
            current = apply_gate(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            current = module.act_fn(gate) * up
        current = F.linear(current, module.down_proj[expert])
        current = current * top_k_weights[token_idx, top_k_pos, None]
        output.index_add_(0, token_idx, current.to(output.dtype))
    return output
