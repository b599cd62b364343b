"""A loss computed from the gathered logits, the same way on every rank, gives the unsharded gradients.

Wherever a plan gathers an output for the caller (the sequence under ``--cp``, the
vocabulary under ``--tp``, the sequence under ``--sp``, the tokens under DP attention),
the gather's backward keeps this rank's part of the (identical) gradient each rank
computes; summing those copies would count the loss once per rank. The matrix: the losses
of :data:`tests.support.loss_cases.LOSSES` x the planner's modes, against one process, on
real gloo ranks (one spawn of 2 ranks for the 1-D meshes, one of 4 for ``cp 2 x tp 2``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_distributed
from tests.support.loss_cases import LOSSES, LossCase, LossCell, run_loss_cases
from tests.support.models import lower_family, make_config

UNEVEN = dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96)  # 3 key/value heads over tp 2
TWO_RANKS = {
    "cp 2": ("llama", (("cp", 2),), dict(cp=2)),
    "tp 2": ("llama", (("tp", 2),), dict(tp=2)),
    "tp 2 + sp": ("llama", (("tp", 2),), dict(tp=2, sp=True)),
    "ep 2": ("qwen3_moe", (("ep", 2),), dict(ep=2)),
    "ep 2 + attn-dp": ("qwen3_moe", (("ep", 2),), dict(ep=2, attn_dp=True)),
    "tp 2, uneven heads": ("llama", (("tp", 2),), dict(tp=2, config=UNEVEN)),
}
FOUR_RANKS = {
    "cp 2 x tp 2": ("llama", (("cp", 2), ("tp", 2)), dict(cp=2, tp=2)),
    "cp 2 x tp 2 + sp": ("llama", (("cp", 2), ("tp", 2)), dict(cp=2, tp=2, sp=True)),
}


def _plan(family: str, attn_dp: bool = False, config: dict | None = None, **flags: Any) -> dict[str, Any]:
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.passes.data_parallel_attention import data_parallel_attention

    model = meta_model(make_config(family, **(config or {})))
    plan = plan_model(model, name=family, **flags)
    return data_parallel_attention(model, plan, family) if attn_dp else plan


def _cases(tmp: Path, modes: dict[str, tuple]) -> list[LossCase]:
    cases = []
    for name, (family, mesh, flags) in modes.items():
        plan = _plan(family, **flags)
        folder = tmp / "".join(c if c.isalnum() else "_" for c in name)
        folder.mkdir()
        path = str(lower_family(family, plan, folder))
        cases.append(LossCase(name, family, path, plan, mesh, config=flags.get("config", {})))
    return cases


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, LossCell]]]:
    """Mode -> each rank's cells."""
    tmp = tmp_path_factory.mktemp("losses")
    found: dict[str, list[dict[str, LossCell]]] = {}
    for modes, world_size in ((TWO_RANKS, 2), (FOUR_RANKS, 4)):
        ranks = run_distributed(run_loss_cases, _cases(tmp, modes), world_size=world_size, timeout=300)
        for name in modes:
            found[name] = [by_case[name] for by_case in ranks]
    return found


@pytest.mark.parametrize("mode", [*TWO_RANKS, *FOUR_RANKS])
@pytest.mark.parametrize("loss", LOSSES)
def test_a_loss_from_the_gathered_logits_gives_the_unsharded_gradients(matrix, mode: str, loss: str) -> None:
    for rank, cells in enumerate(matrix[mode]):
        cell = cells[loss]
        print(f"{mode:>16} | {loss:<22} | rank {rank} | max |grad diff| {cell.grad_err:.2e} (tol {cell.grad_tol:.2e})")
        assert not cell.failures, f"{mode}, {loss}, rank {rank}: " + "; ".join(cell.failures[:4])


@pytest.mark.parametrize("mode", [*TWO_RANKS, *FOUR_RANKS])
def test_tuple_output_and_deepcopy(matrix, mode: str) -> None:
    """``return_dict=False`` returns the gathered logits; ``copy.deepcopy`` of the model runs as the model."""
    for rank, cells in enumerate(matrix[mode]):
        assert not cells["tuple and copy"].failures, f"{mode}, rank {rank}: " + "; ".join(cells["tuple and copy"].failures)
