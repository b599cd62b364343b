"""Serving DP attention (``--ep N --attn-dp``, each rank its own requests): the router logits a rank returns are
those of its own tokens, and a rank with no request returns none, not its placeholder sequence's.

A rank whose share is empty runs a placeholder sequence so that it joins the experts' collectives
(:func:`hpgen.runtime.forward.local.batch_parallel`); its rows are dropped from the outputs. Left in
``router_logits``, they would be counted by the auxiliary load-balancing loss as tokens that do
not exist (and with an ``attention_mask`` of no rows, the loss would fail on their shapes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.runtime.forward.test_dp_attention import FAMILY, dp_attention_plan
from tests.support.dist import run_distributed
from tests.support.models import generated_model, import_file, lower_family, make_config, reference_model, tolerance


def _router(rank: int, world_size: int, path: str, plan: dict) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.runtime import parallelize

    config = make_config(FAMILY)
    reference = reference_model(FAMILY, config, 0)
    model = generated_model(import_file(path), FAMILY, config, reference)
    parallelize(model, plan, init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",)), check_inputs=False)
    ids = torch.randint(0, 127, (2, 5), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(ids)
    found: dict[str, Any] = {}
    with torch.no_grad():
        for masked in (False, True):
            kwargs = {"attention_mask": mask} if masked else {}
            want = reference(ids, output_router_logits=True, **kwargs)
            # rank 0: its two requests; rank 1: none this step (it runs the placeholder)
            step = ids if rank == 0 else ids[:0]
            got = model(step, output_router_logits=True, **({"attention_mask": mask[: len(step)]} if masked else {}))
            rows = [tuple(layer.shape) for layer in got.router_logits]
            if rank == 0:
                same = all(
                    (mine - theirs).abs().max().item() <= tolerance(theirs)
                    for mine, theirs in zip(got.router_logits, want.router_logits)
                )
                found[f"mask {masked}"] = (rows, same, (got.aux_loss - want.aux_loss).abs().item() <= 1e-5)
            else:
                found[f"mask {masked}"] = (rows, bool(torch.isnan(got.aux_loss)))
    return found


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("dp_router")
    plan = dp_attention_plan("serving")
    path = str(lower_family(FAMILY, plan, Path(directory)))
    return run_distributed(_router, path, plan, world_size=2, timeout=300)


def test_a_rank_returns_its_own_tokens_router_logits(results) -> None:
    layers = make_config(FAMILY).num_hidden_layers
    experts = make_config(FAMILY).num_experts
    for masked in (False, True):
        rows, same, aux = results[0][f"mask {masked}"]
        assert rows == [(10, experts)] * layers and same and aux, results[0]


def test_a_rank_without_requests_returns_no_router_logits(results) -> None:
    experts = make_config(FAMILY).num_experts
    for masked in (False, True):
        rows, nan = results[1][f"mask {masked}"]
        assert rows == [(0, experts)] * make_config(FAMILY).num_hidden_layers, f"rank 1, mask {masked}: {rows}"
        assert nan  # transformers' load-balancing loss of no tokens (0 / 0), not one of the placeholder's
