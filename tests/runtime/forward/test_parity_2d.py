"""Beyond one axis, on 4 gloo ranks (one spawn for every case), against the unsharded models.

- Composition (``dp x tp`` = 2 x 2): the model parallelized on ``tp``, then FSDP2
  (``fully_shard`` per decoder layer and root, or the root only) or DDP on ``dp``; each
  ``dp`` rank takes half the batch. Loss, logits, every gradient and every weight after one
  AdamW step equal the unsharded model's on the whole batch: Llama with sequence-parallel
  norms (``grad_reduce_params``), Qwen3's per-head q/k norms, and key/value heads
  replicated on 2 ranks (``RS(0,2)``, one KV head at ``tp`` 2) under FSDP2.
- Experts on their own axis (``ep x tp`` = 2 x 2, plans from ``hpgen plan --tp 2 --ep 2
  --ep-axis ep``): Qwen3-MoE and Mixtral with transformers' default expert kernels.
- Key/value heads replicated (``hpgen plan --tp 4`` of 2 KV heads): Llama, Qwen2 (biases)
  and Qwen3 (k_norm) at ``tp`` 4; logits, every gradient, greedy generation with the cache.
- Toggle mode on any mesh: one ``--mode toggle`` Qwen3-MoE file run unparallelized, on
  ``tp`` alone (4 ranks; its ``ep`` axis off), on ``dp x tp`` under FSDP2 and on ``ep x tp``.
- DCP checkpoints of FSDP2 x hpgen models (``dp x tp``, Llama with a vocab-parallel
  embedding and sequence-parallel norms, Qwen3): ``state_dict()`` gives DTensors of the
  global shape whose ``full_tensor()`` is the unsharded weight; the checkpoint loads into a
  fresh FSDP2 x hpgen model (bit-exact weights and logits), transformers' unsharded model
  and an hpgen model on ``tp`` alone; a full state dict loads into FSDP2's pieces; the
  optimizer state after an AdamW step (``optimizer_state_dict``) resumes into the same
  three and into transformers' model under FSDP2 alone on 4 ranks (bit-exact moments, the
  unsharded ones those of the same step taken unsharded).
- peft's LoRA (q, k, v, o and the MLP projections of Llama, biases deferred) under FSDP2 x
  hpgen: ``get_peft_model``, ``parallelize`` on ``tp``, ``fully_shard`` on ``dp``; the losses of
  three SGD steps and every adapter after them equal peft's on one process on the whole batch
  (the adapters' ``tp`` gradient sums follow FSDP2's parameters).
- Refusals instead of partial gradients: ``fully_shard`` or DDP before ``parallelize``, an
  FSDP2 unit inside a boundary that reduces a gradient, and replicated KV heads whose
  ``num_key_value_groups`` the plan does not divide.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_distributed
from tests.support.compose import TrainCase, check_training, run_train_cases
from tests.support.compose_checkpoints import CheckpointCase, run_checkpoint_cases
from tests.support.lora import LoraCase, run_lora_fsdp_cases
from tests.support.models import (
    Case,
    check_generation,
    check_gradients,
    check_logits,
    check_share,
    generated_model,
    generated_plan,
    import_file,
    load_plan_dict,
    lower_family,
    make_config,
    reference_model,
    run_cases,
)
from tests.support.parity_table import MOE, PARITY_2D, QWEN3_MOE_EP_TP, lowered_cases

DP_TP = (("dp", 2), ("tp", 2))
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KV1 = {"num_key_value_heads": 1}  # one key/value head: replicated on both tp ranks

TRAINING = ("llama_sp_fsdp2", "llama_sp_fsdp2_root", "llama_sp_ddp", "qwen3_fsdp2", "llama_rs_fsdp2", "toggle_dp_tp")
REFUSALS = {
    "fsdp2_first": ["model.embed_tokens.weight", "already a DTensor", "Call parallelize first"],
    "ddp_first": ["wrapped in DistributedDataParallel", "call parallelize on the model first"],
    "fsdp2_inside_boundary": [
        "model.layers.0.input_layernorm.weight",
        "still a sharded DTensor",
        "Apply fully_shard to model.layers.0 or a module above it",
    ],
    "kv_groups_not_divided": [
        "model.layers.0.self_attn (LlamaAttention)",
        "num_key_value_groups would be 4",
        "axis 'tp' (size 2)",
        "divide_attrs",
    ],
}


def _without_divide_attrs(plan: dict[str, Any]) -> dict[str, Any]:
    plan = copy.deepcopy(plan)
    for entry in plan["param_plan"].values():
        entry.pop("divide_attrs", None)
    return plan


def _refuse(case: tuple[str, str, str, dict[str, Any], dict[str, Any]]) -> str:
    """Run one composition that must be refused; return the error message (or 'no error')."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpgen.runtime import parallelize
    from hpgen.runtime.errors import ParallelizeError

    name, family, generated, plan, overrides = case
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    config = make_config(family, **overrides)
    model = generated_model(import_file(generated), family, config, reference_model(family, config, seed=0))
    try:
        if name == "fsdp2_first":
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            parallelize(model, plan, mesh)
        elif name == "ddp_first":
            from torch.nn.parallel import DistributedDataParallel

            parallelize(DistributedDataParallel(model, process_group=mesh.get_group("dp")), plan, mesh)
        elif name == "fsdp2_inside_boundary":
            parallelize(model, plan, mesh)
            for layer in model.model.layers:
                fully_shard(layer.input_layernorm, mesh=mesh["dp"])  # smaller than the layer boundary
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
        else:
            parallelize(model, plan, mesh)
    except (ParallelizeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _everything(
    rank: int, world_size: int, cases: list, training: list, refusals: list, checkpoints: list, lora: list
) -> dict[str, Any]:
    results: dict[str, Any] = dict(run_cases(rank, world_size, cases))
    results.update(run_train_cases(rank, world_size, training))
    results.update(run_checkpoint_cases(rank, world_size, checkpoints))
    results.update(run_lora_fsdp_cases(rank, world_size, lora))
    results.update({case[0]: _refuse(case) for case in refusals})  # last: a refused forward leaves FSDP2 mid-step
    return results


def build_runs(
    directory: Path,
) -> tuple[list[Case], list[TrainCase], list[tuple], list[CheckpointCase], list[LoraCase]]:
    """Lower the files into ``directory``; the parity cases (``PARITY_2D``), training cases, refusals,
    checkpoints and LoRA under FSDP2 to run."""
    cases = lowered_cases(PARITY_2D, directory)
    toggle = next(case.generated for case in cases if case.name == "toggle_none")
    sp = str(lower_family("llama", "llama_tp_sp", directory))
    qwen3 = str(lower_family("qwen3", "qwen3_tp", directory))
    moe_plan = QWEN3_MOE_EP_TP()
    kv1_plan = generated_plan("llama", KV1, tp=2)
    kv1 = str(lower_family("llama", kv1_plan, directory))
    tp_sp = load_plan_dict("llama_tp_sp")
    training = [
        TrainCase("llama_sp_fsdp2", "llama", sp, tp_sp, DP_TP, "fsdp2"),
        TrainCase("llama_sp_fsdp2_root", "llama", sp, tp_sp, DP_TP, "fsdp2_root"),
        TrainCase("llama_sp_ddp", "llama", sp, tp_sp, DP_TP, "ddp"),
        TrainCase("qwen3_fsdp2", "qwen3", qwen3, load_plan_dict("qwen3_tp"), DP_TP, "fsdp2"),
        TrainCase("llama_rs_fsdp2", "llama", kv1, kv1_plan, DP_TP, "fsdp2", config=KV1),
        TrainCase("toggle_dp_tp", "qwen3_moe", toggle, moe_plan, DP_TP, "fsdp2", config=MOE),
    ]
    refusals = [
        ("fsdp2_first", "llama", sp, tp_sp, {}),
        ("ddp_first", "llama", sp, tp_sp, {}),
        ("fsdp2_inside_boundary", "llama", sp, tp_sp, {}),
        ("kv_groups_not_divided", "llama", kv1, _without_divide_attrs(kv1_plan), KV1),
    ]
    checkpoints = [
        CheckpointCase("llama_sp_dcp", "llama", sp, tp_sp, str(directory / "dcp_llama_sp")),
        CheckpointCase("qwen3_dcp", "qwen3", qwen3, load_plan_dict("qwen3_tp"), str(directory / "dcp_qwen3")),
    ]
    biases = {"attention_bias": True, "mlp_bias": True}
    lora_plan = generated_plan("llama", biases, tp=2)
    lora_file = str(lower_family("llama", lora_plan, directory))
    lora = [LoraCase("lora_fsdp2", "llama", lora_file, lora_plan, LORA_TARGETS, "peft_first", config=biases)]
    return cases, training, refusals, checkpoints, lora


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    runs = build_runs(tmp_path_factory.mktemp("parity_2d"))
    return run_distributed(_everything, *runs, world_size=4, timeout=400)


@pytest.mark.parametrize("name", PARITY_2D)
def test_logits(results: list[dict], name: str) -> None:
    check_logits(results, name)


@pytest.mark.parametrize("name", PARITY_2D)
def test_gradients(results: list[dict], name: str) -> None:
    check_gradients(results, name)


@pytest.mark.parametrize("name", PARITY_2D)
def test_greedy_generation(results: list[dict], name: str) -> None:
    check_generation(results, name)


@pytest.mark.parametrize("name", [name for name, row in PARITY_2D.items() if row.parallel])
def test_each_rank_holds_its_share(results: list[dict], name: str) -> None:
    check_share(results, name)


@pytest.mark.parametrize("name", TRAINING)
def test_training_step(results: list[dict], name: str) -> None:
    check_training(results, name)


@pytest.mark.parametrize("name", REFUSALS)
def test_refused_with_a_message(results: list[dict], name: str) -> None:
    for rank, by_case in enumerate(results):
        message = by_case[name]
        for part in REFUSALS[name]:
            assert part in message, f"rank {rank}: {part!r} not in {message!r}"


CHECKPOINTS = ("llama_sp_dcp", "qwen3_dcp")


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_fsdp2_state_dict_is_global(results: list[dict], name: str) -> None:
    for rank, by_case in enumerate(results):
        result = by_case[name]
        assert result.checked > 0 and result.not_global == [], f"rank {rank}: not global DTensors: {result.not_global}"
        assert result.full_tensor == [], f"rank {rank}: full_tensor() is not the unsharded weight: {result.full_tensor}"
    placements = results[0][name].placements
    # FSDP2 shards dim 0 of the tp shard: right to left over a tp Shard(0), plain Shard(0) over a tp Shard(1)
    assert placements["model.layers.0.self_attn.q_proj.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placements["model.embed_tokens.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"


@pytest.mark.parametrize(
    "target",
    ["fsdp2 x tp", "unsharded", "tp only", "full state dict", "optimizer: fsdp2 x tp", "optimizer: tp only",
     "optimizer: unsharded", "optimizer: fsdp2 4 x 1"],
)
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_fsdp2_checkpoint_loads_back(results: list[dict], name: str, target: str) -> None:
    for rank, by_case in enumerate(results):
        result = by_case[name]
        assert result.mismatches[target] == [], f"rank {rank}: {target}: not bit-equal: {result.mismatches[target]}"
        if target in result.logits:
            err, tol = result.logits[target]
            assert err <= tol, f"rank {rank}: {target}: logits {err} > {tol}"
        if target == "optimizer: unsharded":  # the resumed moments are those of the same step taken unsharded
            err, tol = result.logits["optimizer: unsharded vs the unsharded step"]
            assert err <= tol, f"rank {rank}: exp_avg/exp_avg_sq off by {err} (relative) > {tol}"


def test_lora_under_fsdp2_tracks_peft_on_one_process(results: list[dict]) -> None:
    for rank, by_case in enumerate(results):
        result = by_case["lora_fsdp2"]
        assert len(result.losses) == 3 and result.grads_checked == 28
        for loss, want in zip(result.losses, result.reference_losses):
            assert abs(loss - want) <= 1e-5 + 1e-5 * abs(want), f"rank {rank}: {result.losses}, {result.reference_losses}"
        assert not result.param_failures, f"rank {rank}: " + "; ".join(result.param_failures)
