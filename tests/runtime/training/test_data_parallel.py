"""``hpgen.runtime.training.data_parallel``: DDP or FSDP2 over ``dp x cp``, the engine summing the gradients over cp.

Real gloo ranks, tiny Llama (and Qwen3 with tied embeddings), random weights; the plans are
``hpgen plan --cp 2`` (``--tp 2``) lowered from the installed modeling files. Each case trains a
few optimizer steps with gradient accumulation 4, ``clip_grad_norm_`` and AdamW on the same token
batches as the unsharded model on one process, and compares every weight after them. The engine
makes the sums over cp: after a micro-batch inside ``no_sync`` each cp rank still holds its own
share (the ranks' gradients differ), and the weights still come out equal to one process's.
Beside them: hpgen's own hooks with no engine (a plain loop), FSDP2's optimizer state sharded
over cp, and the DDP guard accepting only the DDP the helper builds (a DDP over tp, or over cp
without the helper, is still refused).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_distributed
from tests.support.engine_runs import EngineCase, EngineResult, run_engine_cases, guard_checks
from tests.support.models import lower_family, make_config


def _spec(tmp: Path, family: str, mesh: tuple[tuple[str, int], ...], config: dict[str, Any], **flags: Any) -> dict[str, Any]:
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    plan = plan_model(meta_model(make_config(family, **config)), name=family, **flags)
    folder = tmp / "_".join(f"{k}{v}" for k, v in flags.items()) / family
    folder.mkdir(parents=True, exist_ok=True)
    return dict(family=family, generated=str(lower_family(family, plan, folder)), plan=plan, mesh=mesh, config=config)


def _check(results: list[dict[str, Any]], name: str) -> EngineResult:
    for rank, by_case in enumerate(results):
        result: EngineResult = by_case[name]
        assert result.weights_checked > 0
        assert not result.weight_failures, f"{name} rank {rank}: after the steps: " + "; ".join(result.weight_failures)
        assert all(e <= t for e, t in zip(result.norm_errs, result.norm_tols)), (name, rank, result.norm_errs)
        assert result.clipped, f"{name}: the clip never clipped (raise the learning signal or lower max_norm)"
    return results[0][name]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("engines2")
    llama = _spec(tmp, "llama", (("cp", 2),), {}, cp=2)
    qwen = _spec(tmp, "qwen3", (("cp", 2),), dict(tie_word_embeddings=True), cp=2)
    cases = [
        EngineCase("llama_cp2_hooks", engine="none", **llama),
        EngineCase("llama_cp2_ddp", engine="ddp", **llama),
        EngineCase("llama_cp2_fsdp2", engine="fsdp2", **llama),
        EngineCase("qwen3_tied_cp2_ddp", engine="ddp", **qwen),
    ]
    return run_distributed(run_engine_cases, cases, guard_checks(llama), world_size=2, timeout=600)


@pytest.mark.parametrize("name", ["llama_cp2_hooks", "llama_cp2_ddp", "llama_cp2_fsdp2", "qwen3_tied_cp2_ddp"])
def test_cp2_training_steps_equal_one_process(two_ranks: list[dict[str, Any]], name: str) -> None:
    _check(two_ranks, name)


@pytest.mark.parametrize("name", ["llama_cp2_ddp", "qwen3_tied_cp2_ddp"])
def test_the_engine_not_hpgen_sums_over_cp(two_ranks: list[dict[str, Any]], name: str) -> None:
    # after the first micro-batch, inside no_sync: each cp rank still holds its own share
    assert all(by_case[name].shares_while_accumulating is True for by_case in two_ranks)


@pytest.mark.parametrize("name", ["llama_cp2_ddp", "llama_cp2_fsdp2", "qwen3_tied_cp2_ddp"])
def test_no_gradient_collective_until_the_last_micro_batch(two_ranks: list[dict[str, Any]], name: str) -> None:
    for by_case in two_ranks:
        *accumulating, last = by_case[name].collectives
        assert accumulating == [0, 0, 0] and last > 0, by_case[name].collectives
        hooks = by_case["llama_cp2_hooks"].collectives  # hpgen's hooks: every parameter, every micro-batch
        assert len(set(hooks)) == 1 and hooks[0] > last, hooks


def test_fsdp2_over_cp_shards_the_optimizer_state(two_ranks: list[dict[str, Any]]) -> None:
    for by_case in two_ranks:
        result = by_case["llama_cp2_fsdp2"]
        assert result.optimizer_bytes <= 0.55 * result.reference_optimizer_bytes, (
            result.optimizer_bytes, result.reference_optimizer_bytes
        )
        hooks = by_case["llama_cp2_hooks"]
        assert hooks.optimizer_bytes == hooks.reference_optimizer_bytes  # cp alone replicates it


def test_a_ddp_over_cp_built_by_hand_is_refused(two_ranks: list[dict[str, Any]]) -> None:
    # hpgen's hooks still sum over cp there, and the data would be split over ranks that must see one batch
    messages = [by_case["guard_cp"] for by_case in two_ranks]
    assert len(set(messages)) == 1 and messages[0] is not None, messages  # the same error on each rank
    assert "runs inside DistributedDataParallel over global ranks 0, 1" in messages[0] and "'cp'" in messages[0]
    assert "hpgen.runtime.training.data_parallel" in messages[0] and "The shards are unchanged" in messages[0]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("engines4")
    dp_cp = _spec(tmp, "llama", (("dp", 2), ("cp", 2)), {}, cp=2)
    cp_tp = _spec(tmp, "llama", (("cp", 2), ("tp", 2)), {}, cp=2, tp=2)
    cases = [
        EngineCase("llama_dp2_cp2_ddp", engine="ddp", batch=4, **dp_cp),
        EngineCase("llama_dp2_cp2_fsdp2", engine="fsdp2", batch=4, **dp_cp),
        EngineCase("llama_cp2_tp2_ddp", engine="ddp", **cp_tp),
        EngineCase("llama_cp2_tp2_fsdp2", engine="fsdp2", **cp_tp),
    ]
    return run_distributed(run_engine_cases, cases, guard_checks(cp_tp, "tp"), world_size=4, timeout=600)


@pytest.mark.parametrize("name", ["llama_dp2_cp2_ddp", "llama_dp2_cp2_fsdp2", "llama_cp2_tp2_ddp", "llama_cp2_tp2_fsdp2"])
def test_dp_x_cp_and_cp_x_tp_training_steps_equal_one_process(four_ranks: list[dict[str, Any]], name: str) -> None:
    _check(four_ranks, name)


def test_the_engine_sums_over_cp_beside_dp_and_tp(four_ranks: list[dict[str, Any]]) -> None:
    for name in ("llama_dp2_cp2_ddp", "llama_cp2_tp2_ddp"):
        assert all(by_case[name].shares_while_accumulating is True for by_case in four_ranks), name
    for by_case in four_ranks:  # FSDP2 over dp x cp: a quarter of the state on each rank
        result = by_case["llama_dp2_cp2_fsdp2"]
        assert result.optimizer_bytes <= 0.3 * result.reference_optimizer_bytes
        for name in ("llama_dp2_cp2_ddp", "llama_dp2_cp2_fsdp2", "llama_cp2_tp2_ddp", "llama_cp2_tp2_fsdp2"):
            *accumulating, last = by_case[name].collectives
            assert accumulating == [0, 0, 0] and last > 0, (name, by_case[name].collectives)


def test_a_ddp_over_tp_is_still_refused_with_the_shards_kept(four_ranks: list[dict[str, Any]]) -> None:
    # "unchanged": the ignore list found the DDP being built (its caller's frame, in this torch) and kept the
    # tp-sharded parameters from its broadcast
    messages = [by_case["guard_tp"] for by_case in four_ranks]
    assert all(message is not None and "'tp'" in message for message in messages), messages
    assert all("The shards are unchanged" in message for message in messages), messages[0]


def test_data_parallel_refuses_what_it_cannot_build() -> None:
    from torch import nn

    from hpgen.runtime.training import data_parallel

    with pytest.raises(ValueError, match="engine='zero3'; one of 'ddp', 'fsdp2'"):
        data_parallel(nn.Linear(2, 2), "zero3")
    with pytest.raises(ValueError, match="Linear was not parallelized by hpgen"):
        data_parallel(nn.Linear(2, 2))
