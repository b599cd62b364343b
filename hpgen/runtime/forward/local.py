"""Local compute functions for region boundaries (``injections[].local_compute_fn``).

A region boundary's generated ``forward`` moves the inputs, calls
``self.__hp_compute__(...)`` and moves the outputs; ``parallelize`` binds
``__hp_compute__`` to ``functools.partial(fn, module, **kwargs)`` with ``fn`` and
``kwargs`` from the plan's injection, e.g.::

    {"match": "model.layers.*.mlp.experts",
     "local_compute_fn": {"_target_": "hpgen.runtime.local.experts_parallel", "axis": "ep"}}

A function may carry a ``prepare(module, **kwargs)`` attribute: ``parallelize`` calls it
once, after sharding, for set-up that needs the local shards.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["batch_parallel", "experts_parallel", "local_experts"]


def local_experts(module: nn.Module, axis: str) -> tuple[int, int]:
    """``(first, count)``: the global ids of the experts this rank holds on ``axis``.

    ``parallelize`` has sharded the expert parameters on dim 0 and refused an expert count
    that does not divide, so rank ``r`` of ``k`` holds ``[r * E / k, (r + 1) * E / k)``.
    """
    found = getattr(module, "_hp_experts", None)
    if found is not None:
        return found
    ax = getattr(module, f"_hp_{axis}")
    count = module.num_experts // ax.size
    return ax.rank * count, count


def _prepare(module: nn.Module, *, axis: str = "ep") -> None:
    """Record this rank's experts and make the module count only those.

    The experts' own code (the eager loop and transformers' kernels alike) then sees
    ``num_experts`` local experts and skips the sentinel id ``num_experts``, which is how
    transformers' own expert parallelism runs them (``_is_expert_parallel`` makes its
    ``grouped_mm``/``batched_mm`` kernels mask the sentinel rows).
    """
    ax = getattr(module, f"_hp_{axis}")
    weight = next(p for name, p in module.named_parameters(recurse=False) if p.dim() == 3)
    count = weight.shape[0]
    if count * ax.size != module.num_experts:
        raise ValueError(
            f"{type(module).__name__}: {count} local experts x {ax.size} ranks of axis {axis!r} "
            f"is not num_experts={module.num_experts}; were the experts sharded on dim 0 over {axis!r}?"
        )
    module._hp_experts = (ax.rank * count, count)
    module.num_experts = count
    if ax.size > 1:
        module._is_expert_parallel = True


def experts_parallel(
    module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *, axis: str = "ep"
) -> Tensor:
    """Expert parallelism for transformers' experts classes (``Qwen3MoeExperts``, ``MixtralExperts``, ...).

    The module's expert parameters (``[E, ...]``) are sharded on dim 0 over ``axis``: this
    rank holds experts ``[first, first + count)`` (see :func:`local_experts`).
    ``hidden_states`` is ``[tokens, H]`` (replicated), ``top_k_index`` and
    ``top_k_weights`` are ``[tokens, top_k]`` with the routed global expert ids. Ids of
    other ranks' experts become the local sentinel ``count`` (no expert), and the
    module's own body runs on the local experts: its eager loop, or the kernel that
    transformers' ``config._experts_implementation`` selects (``grouped_mm`` by default;
    :mod:`hpgen.runtime.install.kernels` routes the dispatch there). Any weight layout the class
    supports (transposed, with biases) works, since the class's code computes.

    The result is this rank's partial sum (``P(sum)``) over ``axis``; the generated
    ``forward``'s output op all-reduces it. Without ``parallelize`` (axis of size 1) it
    computes the whole layer.
    """
    first, count = local_experts(module, axis)
    mine = (top_k_index >= first) & (top_k_index < first + count)
    local_index = torch.where(mine, top_k_index - first, torch.full_like(top_k_index, count))
    local_weights = top_k_weights.masked_fill(~mine, 0.0)
    return module._forward_impl(hidden_states, local_index, local_weights)


experts_parallel.prepare = _prepare  # type: ignore[attr-defined]


def batch_parallel(module: nn.Module, *args: Any, axis: str = "ep", **kwargs: Any) -> Any:
    """The module's body on this rank's share of a batch split over ``axis`` (data-parallel
    attention: the decoder stack on each rank's sequences, the experts on everyone's tokens).

    A rank whose share is empty (3 sequences on 4 ranks, one sequence in ``generate`` on 2)
    must still join the experts' collectives of every layer, but transformers' attention
    cannot run on zero sequences (its ``view(..., -1, head_dim)``). So it runs one
    placeholder sequence instead: each tensor argument of zero rows becomes one row (ones
    for ``attention_mask``, zeros otherwise), and the placeholder's rows are dropped from
    the outputs (``last_hidden_state``, ``hidden_states``, ``attentions``) and from what
    transformers records on the way (``output_router_logits``, ``output_hidden_states``,
    ``output_attentions``: left there, an auxiliary load-balancing loss would count the
    placeholder's tokens, which do not exist). Nothing of the
    placeholder reaches another rank's tokens: the experts treat each token alone and the
    scatter after them returns each rank its own rows; a cache keeps its row from step to
    step, as it keeps the real ones. Its gradient is zero.
    """
    bound = inspect.signature(module._forward_impl).bind(*args, **kwargs)
    first = next((v for v in bound.arguments.values() if isinstance(v, Tensor)), None)
    if first is None or first.dim() == 0 or first.size(0) > 0:
        return module._forward_impl(*args, **kwargs)
    for name, value in bound.arguments.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.size(0) == 0:
            fill = torch.ones if name == "attention_mask" else torch.zeros
            bound.arguments[name] = fill((1, *value.shape[1:]), dtype=value.dtype, device=value.device)
    recorded = _recorded_outputs()
    counts = {key: len(values) for key, values in recorded.items() if isinstance(values, list)}
    outputs = _without_placeholder(module._forward_impl(*bound.args, **bound.kwargs))
    for key, count in counts.items():  # recorded during the placeholder's run: all of them its rows
        recorded[key][count:] = [_no_rows(value) for value in recorded[key][count:]]
    return outputs


def _recorded_outputs() -> dict[str, Any]:
    """What transformers' ``capture_outputs`` is recording in this forward (router logits, hidden states,
    attentions, by key; each a list it appends a layer's output to), or nothing."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without output capturing: nothing is recorded
        return {}
    return _active_collector.get() or {}


def _no_rows(value: Any) -> Any:
    """``value`` with none of its rows (a tensor, or a tuple of them): a recorded output of the placeholder alone."""
    if isinstance(value, Tensor) and value.dim() > 0:
        return value[:0]
    if type(value) is tuple:
        return tuple(_no_rows(v) for v in value)
    return value


def _without_placeholder(outputs: Any) -> Any:
    """``outputs`` with the placeholder's row dropped from each per-sequence tensor (and tuple of them)."""

    def drop(value: Any) -> Any:
        if isinstance(value, Tensor) and value.dim() > 0 and value.size(0) == 1:
            return value[:0]
        if type(value) is tuple and value and all(isinstance(v, Tensor) for v in value):
            return tuple(drop(v) for v in value)
        return value

    if isinstance(outputs, dict):  # a ModelOutput: update in place, keeping its class
        for key in ("last_hidden_state", "hidden_states", "attentions"):
            if outputs.get(key) is not None:
                outputs[key] = drop(outputs[key])
        return outputs
    return drop(outputs)
