"""cp attention's recomputing backward (:class:`hpgen.runtime.context_attention.RecomputedAttention`) on 2 gloo ranks.

A cp training step's attention call saves only this rank's queries, keys and values and
recomputes the attention in backward. Keyword tensors of the call (a learned
``position_bias``, which transformers' sdpa adds to the scores) must get their gradients
from that recomputation too, as in the unsharded call; so must the queries, keys and values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.support.dist import run_distributed
from tests.support.models import tolerance

B, H, N, D = 2, 2, 11, 8  # 11 tokens: uneven head-tail chunks (3, 3, 3, 2)


def _attention(rank: int, world_size: int) -> dict[str, tuple[float, float]]:
    import torch.distributed as dist
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hpgen.runtime.context_attention import recomputed_attention
    from hpgen.runtime.forward.context_axis import ContextAxis

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(B, H, N, D, generator=generator) for _ in range(3))
    bias = torch.randn(1, H, N, N, generator=generator)
    mask = torch.ones(N, N, dtype=torch.bool).tril()[None, None].expand(B, 1, N, N)
    w = torch.randn(B, N, H, D, generator=generator)
    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 1, True

    whole = [t.clone().requires_grad_() for t in (query, key, value, bias)]
    out, _ = sdpa_attention_forward(module, *whole[:3], mask, position_bias=whole[3])
    (out * w).sum().backward()

    ax = ContextAxis(dist.group.WORLD, "cp")
    layout = ax.layout(N, torch.device("cpu"))
    module._hp_cp_layout, module._hp_cp_axis = layout, ax
    mine = [t.clone().requires_grad_() for t in (query, key, value, bias)]
    local = [t.index_select(2, layout.local) for t in mine]  # this rank's rows (of the bias: its query rows)
    out, _ = recomputed_attention(module, *local[:3], mask.index_select(2, layout.local), position_bias=local[3])
    (out * w.index_select(1, layout.local)).sum().backward()
    found = {}
    for name, ref, got in zip(("query", "key", "value", "position_bias"), whole, mine):
        if got.grad is None:
            found[name] = (float("inf"), 0.0)
            continue
        grad = got.grad.clone()
        dist.all_reduce(grad)  # each rank's part of the whole tensor's gradient
        found[name] = ((grad - ref.grad).abs().max().item(), tolerance(ref.grad))
    return found


def test_recomputed_attention_gives_keyword_tensors_their_gradients() -> None:
    for rank, found in enumerate(run_distributed(_attention, world_size=2, timeout=120)):
        for name, (err, tol) in found.items():
            assert err <= tol, f"rank {rank}: {name} gradient {err:.2e} > {tol:.2e}"
        assert set(found) == {"query", "key", "value", "position_bias"}
