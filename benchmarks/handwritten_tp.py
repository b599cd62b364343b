"""Hand-written tensor parallelism for transformers' Llama, gpt-fast style: the speed baseline.

Weights are sliced by hand and one all-reduce per attention block and per MLP block runs in
a forward hook, the way gpt-fast's ``tp.py`` does it. Nothing else changes: the modeling
code infers its local head count from ``view(..., -1, head_dim)``, and the KV cache sizes
itself from the first keys it sees, so the head counts follow the sliced weights.

Inference only (the benchmark runs under ``torch.no_grad``). ``functional=False`` (eager)
reduces in place with ``dist.all_reduce``; ``functional=True`` returns the result of
torch's functional ``all_reduce`` from the hook, as gpt-fast's ``tp.py`` does so that
``torch.compile`` traces the collective into the graph (``_c10d_functional``).
"""

from __future__ import annotations

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn


def _keep_rows(linear: nn.Linear, rank: int, size: int) -> None:
    """Column-parallel: this rank keeps its contiguous block of output features."""
    rows = linear.out_features // size
    linear.weight = nn.Parameter(linear.weight.detach()[rank * rows : (rank + 1) * rows].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rank * rows : (rank + 1) * rows].clone())
    linear.out_features = rows


def _keep_columns(linear: nn.Linear, rank: int, size: int) -> None:
    """Row-parallel: this rank keeps its block of input features (a bias would be added
    once after the all-reduce; Llama's projections have none)."""
    if linear.bias is not None:
        raise NotImplementedError("row-parallel bias: Llama's projections have none")
    columns = linear.in_features // size
    linear.weight = nn.Parameter(linear.weight.detach()[:, rank * columns : (rank + 1) * columns].clone())
    linear.in_features = columns


def reduce_output_hook(group: dist.ProcessGroup, *, functional: bool = False):
    """A forward hook all-reducing a block's output (the first item of a tuple): in place with
    ``dist.all_reduce``, or, ``functional``, returning torch's functional ``all_reduce`` (traced by Dynamo)."""

    def all_reduce_output(module: nn.Module, args: tuple, output):
        dist.all_reduce(output[0] if isinstance(output, tuple) else output, group=group)

    def functional_all_reduce_output(module: nn.Module, args: tuple, output):
        if isinstance(output, tuple):
            return (funcol.all_reduce(output[0], "sum", group), *output[1:])
        return funcol.all_reduce(output, "sum", group)

    return functional_all_reduce_output if functional else all_reduce_output


def shard_llama_(model: nn.Module, group: dist.ProcessGroup, *, functional: bool = False) -> nn.Module:
    """Shard every decoder layer of a transformers ``LlamaForCausalLM`` over ``group`` in place.

    Attention heads and key/value heads are split in contiguous blocks, so each rank's query
    heads still map to its own key/value heads (GQA). Embeddings, norms and ``lm_head`` stay
    replicated, as in gpt-fast.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    config = model.config
    if config.num_attention_heads % size or config.num_key_value_heads % size or config.intermediate_size % size:
        raise ValueError(f"heads, KV heads and the MLP width must divide by the TP size {size}")

    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
            _keep_rows(projection, rank, size)
        _keep_columns(attention.o_proj, rank, size)
        for projection in (mlp.gate_proj, mlp.up_proj):
            _keep_rows(projection, rank, size)
        _keep_columns(mlp.down_proj, rank, size)
        hook = reduce_output_hook(group, functional=functional)
        attention.register_forward_hook(hook)
        mlp.register_forward_hook(hook)
    return model
