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
    # new_decoder_architecture: the fused rows are whole key/value groups in contiguous blocks (vLLM's Falcon);
    # multi-query (Falcon-7B's default layout): each rank its query heads with the one key and value head
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


def _keep_query_heads(attention: nn.Module, rank: int, size: int) -> None:
    """Multi-query Falcon (``[query heads | key | value]`` rows): this rank keeps its query heads (``tensor_split``'s
    share, the first ranks one more where they do not divide) and the one key and value head, as vLLM replicates
    key/value heads fewer than the ranks; ``dense`` keeps the matching input features."""
    heads, head_dim = attention.num_heads, attention.head_dim
    counts = [len(part) for part in torch.arange(heads).tensor_split(size)]
    first = sum(counts[:rank])
    rows = torch.cat([torch.arange(first * head_dim, (first + counts[rank]) * head_dim), torch.arange(heads * head_dim, (heads + 2) * head_dim)])
    fused = attention.query_key_value
    fused.weight = nn.Parameter(fused.weight.detach()[rows].clone())
    if fused.bias is not None:
        fused.bias = nn.Parameter(fused.bias.detach()[rows].clone())
    fused.out_features = len(rows)
    dense = attention.dense
    dense.weight = nn.Parameter(dense.weight.detach()[:, first * head_dim : (first + counts[rank]) * head_dim].clone())
    dense.in_features = counts[rank] * head_dim
    if dense.bias is not None and rank != 0:
        dense.bias = nn.Parameter(torch.zeros_like(dense.bias))
    attention.num_heads = counts[rank]


def shard_parallel_residual_(model: nn.Module, group: dist.ProcessGroup, *, functional: bool = False) -> nn.Module:
    """Shard every layer's attention and MLP of a GPT-NeoX / GPT-J / Phi / Falcon causal LM in place."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    path, attention, columns, row, mlp, mlp_columns, mlp_row = LAYOUTS[model.config.model_type]
    config = model.config
    multi_query = config.model_type == "falcon" and config.multi_query and not config.new_decoder_architecture

    hook = reduce_output_hook(group, functional=functional)
    for layer in model.get_submodule(path):
        for block, block_columns, block_row in ((attention, columns, row), (mlp, mlp_columns, mlp_row)):
            module = layer.get_submodule(block)
            if multi_query and block == attention:
                _keep_query_heads(module, rank, size)
                module.register_forward_hook(hook)
                continue
            for name in block_columns:
                _keep_rows(module.get_submodule(name), rank, size)
            _keep_columns(module.get_submodule(block_row), rank, size)
            for count in HEAD_COUNTS if block == attention else ():
                if isinstance(getattr(module, count, None), int):
                    setattr(module, count, getattr(module, count) // size)
            module.register_forward_hook(hook)
    return model
