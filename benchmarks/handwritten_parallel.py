"""Hand-written tensor parallelism for parallel-residual blocks (GPT-NeoX, GPT-J, Phi, Falcon): the baseline.

As vLLM's GPT-NeoX, GPT-J and Phi do it: the attention's q/k/v (GPT-NeoX's fused
``query_key_value``, heads in contiguous blocks) and the MLP's first projection are
column-parallel, the output projections row-parallel, and each of the attention and the
MLP all-reduces its output in a forward hook: two all-reduces a layer. A row-parallel
bias is kept on the first rank only (zeros elsewhere), so the reduction adds it once.
Embeddings, norms and ``lm_head`` stay replicated, as in :mod:`handwritten_tp`.

Inference only. ``functional=True`` returns torch's functional ``all_reduce`` from the
hooks so that ``torch.compile`` traces the collective (gpt-fast's ``tp.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from handwritten_tp import _keep_rows, reduce_output_hook
from torch import nn

# model type -> (layers attribute path, attention, its column projections, its row projection, mlp, columns, row)
LAYOUTS = {
    "gpt_neox": ("gpt_neox.layers", "attention", ("query_key_value",), "dense", "mlp", ("dense_h_to_4h",), "dense_4h_to_h"),
    "gptj": ("transformer.h", "attn", ("q_proj", "k_proj", "v_proj"), "out_proj", "mlp", ("fc_in",), "fc_out"),
    "phi": ("model.layers", "self_attn", ("q_proj", "k_proj", "v_proj"), "dense", "mlp", ("fc1",), "fc2"),
    # new_decoder_architecture: the fused rows are whole key/value groups in contiguous blocks (vLLM's Falcon)
    "falcon": ("transformer.h", "self_attention", ("query_key_value",), "dense", "mlp", ("dense_h_to_4h",), "dense_4h_to_h"),
}
# attention attributes that count the heads a rank holds (Falcon's views read them)
HEAD_COUNTS = ("num_heads", "num_kv_heads")


def _keep_columns(linear: nn.Linear, rank: int, size: int) -> None:
    """Row-parallel: this rank keeps its block of input features; the bias lives on rank 0 only."""
    columns = linear.in_features // size
    linear.weight = nn.Parameter(linear.weight.detach()[:, rank * columns : (rank + 1) * columns].clone())
    linear.in_features = columns
    if linear.bias is not None and rank != 0:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias))


def shard_parallel_residual_(model: nn.Module, group: dist.ProcessGroup, *, functional: bool = False) -> nn.Module:
    """Shard every layer's attention and MLP of a GPT-NeoX / GPT-J / Phi / Falcon causal LM in place."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    path, attention, columns, row, mlp, mlp_columns, mlp_row = LAYOUTS[model.config.model_type]

    hook = reduce_output_hook(group, functional=functional)
    for layer in model.get_submodule(path):
        for block, block_columns, block_row in ((attention, columns, row), (mlp, mlp_columns, mlp_row)):
            module = layer.get_submodule(block)
            for name in block_columns:
                _keep_rows(module.get_submodule(name), rank, size)
            _keep_columns(module.get_submodule(block_row), rank, size)
            for count in HEAD_COUNTS if block == attention else ():
                if isinstance(getattr(module, count, None), int):
                    setattr(module, count, getattr(module, count) // size)
            module.register_forward_hook(hook)
    return model
