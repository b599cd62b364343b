"""``hpgen.runtime.clip_grad_norm_`` in the loops users run, on 4 gloo ranks (one spawn for every case).

Each case trains a tiny Llama (Qwen3-MoE for experts) 3 AdamW steps with clipping active at every step, parallelized,
and unsharded on one process with ``torch.nn.utils.clip_grad_norm_`` (tests/support/clipping.py):
the norm hpgen returns equals the unsharded model's on every rank at every step, and the weights
after the steps equal the unsharded run's. Layouts: ``tp`` 2 (two copies of the model, each on a
``tp`` submesh of the 2 x 2 mesh), ``tp`` 2 with ``--sp``, key/value heads replicated at ``tp`` 4
(``RS(0,2)``), FSDP2 and DDP on ``dp`` over ``tp`` (2 x 2), Qwen3-MoE's experts on an ``ep``
axis over ``tp`` (2 x 2), peft's LoRA on a ``tp`` model (only
the adapters train), the ``inf`` norm (a row-parallel weight's gradient scaled up, so that its largest
element lies on one rank) and ``p = 3``; and a ``nan`` or ``inf`` gradient, handled as torch
does. torch's own clip on the same model sees each rank's shards: its norm differs, which is
checked too, so that the cases would catch clipping done locally.

FSDP2 over hpgen exports the unsharded model after those steps (dp x tp 2 x 2, and tp 4 under
``fully_shard`` on a (1, 4) mesh): ``full_state_dict`` equals the unsharded run's,
``save_pretrained`` loads into transformers' class with its logits, and
``optimizer_state_dict``'s moments are the unsharded AdamW's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_distributed
from tests.support.clipping import MAX_NORM, ClipCase, run_clip_cases
from tests.support.models import generated_plan, load_plan_dict, lower_family
from tests.support.parity_table import MOE, QWEN3_MOE_EP_TP

DP_TP = (("dp", 2), ("tp", 2))
TP4 = (("tp", 4),)
EVEN = {"intermediate_size": 96}
LOOPS = (
    "tp2",
    "tp2_sp",
    "tp2_inf",
    "tp2_p3_model",
    "tp4_rs",
    "fsdp2_dp_tp",
    "fsdp2_tp4",
    "moe_ep_tp",
    "ddp_dp_tp",
    "lora_tp2",
)
EXPORTED = ("fsdp2_dp_tp", "fsdp2_tp4")
TOL = 2e-5  # float32 sums of tiny gradients in another order; a local norm is off by far more


def build_cases(directory: Path) -> list[ClipCase]:
    tp = str(lower_family("llama", "llama_tp", directory))
    sp = str(lower_family("llama", "llama_tp_sp", directory))
    rs_plan = generated_plan("llama", tp=4)  # 2 key/value heads on 4 ranks: RS(0,2)
    rs = str(lower_family("llama", rs_plan, directory))
    # FSDP2 x hpgen state dicts need shards DTensor can name: tensor_split and chunk differ for 89 rows on 4 ranks
    even_plan = generated_plan("llama", EVEN, tp=4)
    even = str(lower_family("llama", even_plan, directory))
    moe_plan = QWEN3_MOE_EP_TP()  # hpgen plan --tp 2 --ep 2 --ep-axis ep: whole experts per ep rank
    moe = str(lower_family("qwen3_moe", moe_plan, directory))
    tp_plan, sp_plan = load_plan_dict("llama_tp"), load_plan_dict("llama_tp_sp")
    return [
        ClipCase("tp2", "llama", tp, tp_plan, DP_TP, axis="tp"),
        ClipCase("tp2_sp", "llama", sp, sp_plan, DP_TP, axis="tp"),
        ClipCase("tp2_inf", "llama", tp, tp_plan, DP_TP, axis="tp", norm_type=math.inf, boost="model.layers.1.mlp.down_proj.weight"),
        ClipCase("tp2_p3_model", "llama", tp, tp_plan, DP_TP, axis="tp", norm_type=3.0, given="model"),
        ClipCase("tp4_rs", "llama", rs, rs_plan, TP4),
        ClipCase("fsdp2_dp_tp", "llama", sp, sp_plan, DP_TP, engine="fsdp2", export=str(directory / "fsdp2_dp_tp")),
        ClipCase(
            "fsdp2_tp4",
            "llama",
            even,
            even_plan,
            (("dp", 1), ("tp", 4)),
            engine="fsdp2",
            config=EVEN,
            export=str(directory / "tp4"),
        ),
        ClipCase("moe_ep_tp", "qwen3_moe", moe, moe_plan, (("ep", 2), ("tp", 2)), config=MOE),
        ClipCase("ddp_dp_tp", "llama", tp, tp_plan, DP_TP, engine="ddp", given="model"),
        ClipCase("lora_tp2", "llama", tp, tp_plan, DP_TP, axis="tp", lora=True),
        ClipCase("nonfinite", "llama", tp, tp_plan, DP_TP, axis="tp", nonfinite=True),
    ]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    cases = build_cases(tmp_path_factory.mktemp("clipping"))
    return run_distributed(run_clip_cases, cases, world_size=4, timeout=400)


@pytest.mark.parametrize("name", LOOPS)
def test_the_norm_is_the_unsharded_models_at_every_step(results: list[dict], name: str) -> None:
    for rank, by_case in enumerate(results):
        result = by_case[name]
        assert len(result.norms) == len(result.reference_norms) > 0
        assert min(result.reference_norms) > MAX_NORM, "clipping must be active at every step"
        for step, (norm, want) in enumerate(zip(result.norms, result.reference_norms)):
            assert abs(norm - want) <= TOL * max(1.0, want), f"rank {rank} step {step}: {norm} != {want}"
    # torch's own clip on the parallelized model sees each rank's shards only (for inf: wrong where the max is not)
    first = results[0][name].reference_norms[0]
    local = [by_case[name].local_norm for by_case in results]
    assert any(abs(norm - first) > 1e-3 * first for norm in local), f"local norms {local}: the case shards nothing"


@pytest.mark.parametrize("name", LOOPS)
def test_the_weights_after_clipped_steps_are_the_unsharded_runs(results: list[dict], name: str) -> None:
    for rank, by_case in enumerate(results):
        result = by_case[name]
        assert result.weights_checked > 0
        assert result.weight_err <= 1e-5, f"rank {rank}: weights {result.weight_err:.3g} off"
        for loss, want in zip(result.losses, result.reference_losses):
            assert abs(loss - want) <= 1e-5, f"rank {rank}: loss {loss} != {want}"


def test_a_nonfinite_gradient_is_handled_as_torch_does(results: list[dict]) -> None:
    holders = 0
    for rank, by_case in enumerate(results):
        extra = by_case["nonfinite"].extra
        holders += extra["inf"]["holds"]
        for bad in ("nan", "inf"):
            seen = extra[bad]
            assert seen["reference_message"].startswith("The total norm of order 2.0"), seen["reference_message"]
            assert seen["message"] == seen["reference_message"], f"rank {rank}: {seen['message']}"
            reference_norm = seen["reference_norm"]
            assert (math.isnan(seen["norm"]) and math.isnan(reference_norm)) or seen["norm"] == reference_norm
        nan, inf = extra["nan"], extra["inf"]
        assert math.isnan(nan["norm"]) and inf["norm"] == math.inf
        # scaled by max_norm / inf = 0: zero everywhere, nan where the inf was (on the rank holding it)
        assert inf["largest"] == inf["reference_largest"] == 0.0
        assert inf["reference_nans"] == 1 and inf["nans"] == (1 if inf["holds"] else 0)
    assert holders == 2  # one rank of each of the two copies of the model


@pytest.mark.parametrize("name", EXPORTED)
def test_fsdp2_over_hpgen_exports_the_unsharded_model(results: list[dict], name: str) -> None:
    """full_state_dict, save_pretrained (loaded by transformers) and optimizer_state_dict of FSDP2 x hpgen."""
    first = results[0][name].extra
    assert first["full_keys"], "full_state_dict's keys are not the unsharded model's"
    assert first["full_err"] <= 1e-5, f"full_state_dict: {first['full_err']:.3g} off"
    for rank, by_case in enumerate(results):
        extra = by_case[name].extra
        assert extra["logits_err"] <= 1e-4, f"rank {rank}: save_pretrained's logits {extra['logits_err']:.3g} off"
        assert extra["moments"] > 0 and extra["moments_err"] <= 1e-5, f"rank {rank}: moments {extra['moments_err']}"
