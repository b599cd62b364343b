"""peft's LoRA on parallelized models, 2 gloo ranks, every case in one spawn (``tests/support/lora.py``).

Llama planned by ``hpgen plan --tp 2`` (with the o_proj/down_proj biases deferred) with
LoRA on q, k, v, o and the MLP projections, in both orders of ``parallelize`` and
``get_peft_model``; the attention of Qwen3-MoE (its experts untouched); GPT-2's ``Conv1D``
layers (the fused ``c_attn`` as three packed blocks); methods that cannot be sharded
(DoRA, ``lora_bias`` on a row-parallel layer), refused on every rank; and the adapter's
lifecycle (``tests/support/lora_lifecycle.py``).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_distributed
from tests.support.lora import LoraCase, LoraResult, run_lora_cases
from tests.support.models import generated_plan, lower_family

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BIASES = {"attention_bias": True, "mlp_bias": True}
KV1 = {"num_key_value_heads": 1}
LORA_BIAS = {"lora_bias": True}
DROPOUT = {"lora_dropout": 0.5}
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # inputs replicated; o_proj, down_proj: sharded


def _gpt2(directory: Path) -> tuple[dict[str, Any], str]:
    from hpgen.generator.generate import infer_package
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.model.load import meta_model, model_class_for
    from hpgen.planner.entry.make import plan_model
    from tests.support.derived_configs import tiny

    plan = plan_model(meta_model(tiny("gpt2")), tp=2, from_source=True, name="gpt2")
    source = Path(inspect.getsourcefile(model_class_for(tiny("gpt2"))) or "")
    text = lower(source.read_text(), plan_from_dict(plan), source_name=source.name, package=infer_package(source))
    path = directory / "gpt2_lora.py"
    path.write_text(text)
    return plan, str(path)


def _cases(directory: Path) -> list[LoraCase]:
    llama_plan = generated_plan("llama", BIASES, tp=2)
    llama = str(lower_family("llama", llama_plan, directory))
    moe_plan = generated_plan("qwen3_moe", tp=2)
    moe = str(lower_family("qwen3_moe", moe_plan, directory))
    gpt2_plan, gpt2 = _gpt2(directory)
    kv1_plan = generated_plan("llama", KV1, tp=2)  # its one key/value head on both ranks: k_proj RS(0,2)
    kv1 = str(lower_family("llama", kv1_plan, directory))
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    return [
        LoraCase("llama_parallelize_first", "llama", llama, llama_plan, LLAMA_TARGETS, config=BIASES, lifecycle=True),
        # lm_head's LoRA layer is a boundary itself: the generic wrapper of an outside class runs it
        LoraCase("llama_peft_first", "llama", llama, llama_plan, (*LLAMA_TARGETS, "lm_head"), "peft_first", BIASES),
        LoraCase("llama_peft_base", "llama", llama, llama_plan, ("q_proj", "o_proj"), "peft_base", BIASES),
        # lora_bias on column-parallel layers: lora_B's bias sharded with its rows
        LoraCase("column_bias", "llama", llama, llama_plan, ("q_proj", "up_proj"), config=BIASES, peft=LORA_BIAS),
        # lora_dropout in train mode, ranks seeded apart: the masks follow the random streams
        LoraCase("dropout", "llama", llama, llama_plan, LLAMA_TARGETS, config=BIASES, peft=DROPOUT, masks=True),
        LoraCase(
            "dropout_peft_first", "llama", llama, llama_plan, LLAMA_TARGETS, "peft_first", BIASES, DROPOUT, masks=True
        ),
        LoraCase("qwen3_moe_attention", "qwen3_moe", moe, moe_plan, attention),
        LoraCase("gpt2_conv1d", "gpt2", gpt2, gpt2_plan, ("c_attn", "c_proj", "c_fc"), "peft_first", config=no_dropout),
        LoraCase(
            "gpt2_conv1d_parallelize_first", "gpt2", gpt2, gpt2_plan, ("c_attn", "c_proj", "c_fc"), config=no_dropout
        ),
        LoraCase("dora", "llama", llama, llama_plan, ("q_proj",), config=BIASES, peft={"use_dora": True}),
        LoraCase("lm_head_after_parallelize", "llama", llama, llama_plan, ("lm_head",), config=BIASES),
        LoraCase("ia3", "llama", llama, llama_plan, ("v_proj",), config=BIASES, tuner="ia3"),
        LoraCase("embedding", "llama", llama, llama_plan, ("embed_tokens",), "peft_first", BIASES),
        LoraCase("replicated_heads", "llama", kv1, kv1_plan, ("k_proj",), "peft_first", KV1),
        LoraCase("row_bias", "llama", llama, llama_plan, ("o_proj",), "peft_first", BIASES, LORA_BIAS),
    ]


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, LoraResult]]:
    directory = tmp_path_factory.mktemp("lora")
    return run_distributed(run_lora_cases, _cases(directory), str(directory), timeout=300)


TRAINED = (
    "llama_parallelize_first",
    "llama_peft_first",
    "llama_peft_base",
    "column_bias",
    "qwen3_moe_attention",
    "gpt2_conv1d",
    "gpt2_conv1d_parallelize_first",
)


@pytest.mark.parametrize("case", TRAINED)
def test_training_matches_peft_on_one_process(lora: list[dict[str, LoraResult]], case: str) -> None:
    for rank, by_case in enumerate(lora):
        result = by_case[case]
        assert result.error is None, f"rank {rank}: {result.error}"
        assert len(result.losses) >= 3
        for loss, want in zip(result.losses, result.reference_losses):
            assert abs(loss - want) <= 1e-5 + 1e-5 * abs(want), f"rank {rank}: {result.losses}"
        assert result.grads_checked > 0
        assert not result.grad_failures, f"rank {rank}: " + "; ".join(result.grad_failures)
        assert not result.param_failures, f"rank {rank} after the steps: " + "; ".join(result.param_failures)


@pytest.mark.parametrize("case", TRAINED)
def test_replicated_adapters_stay_equal_across_ranks(lora: list[dict[str, LoraResult]], case: str) -> None:
    first, second = (by_case[case].replicated for by_case in lora)
    assert first and first.keys() == second.keys()
    assert all(first[name] == second[name] for name in first)


def test_every_llama_adapter_is_checked(lora: list[dict[str, LoraResult]]) -> None:
    assert all(by_case["column_bias"].grads_checked == 12 for by_case in lora)  # 2 layers x 2 x (A, B, B's bias)
    # 2 layers x 7 projections x (A, B, and no lora bias), + lm_head's
    assert all(by_case["llama_parallelize_first"].grads_checked == 28 for by_case in lora)
    assert all(by_case["llama_peft_first"].grads_checked == 30 for by_case in lora)


def test_dora_is_refused_on_every_rank_naming_it(lora: list[dict[str, LoraResult]]) -> None:
    errors = [by_case["dora"].error for by_case in lora]
    assert errors[0] == errors[1] and errors[0] is not None
    assert "DoRA (use_dora=True)" in errors[0] and "self_attn.q_proj" in errors[0]


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("ia3", ("self_attn.v_proj", "IA3", "only LoRA")),
        ("embedding", ("embed_tokens", "Embedding", "not supported")),
        ("replicated_heads", ("self_attn.k_proj", "RS(0,2)", "not supported")),
    ],
)
def test_what_cannot_be_sharded_is_refused_naming_it(lora: list[dict], case: str, words: tuple) -> None:
    errors = [by_case[case].error for by_case in lora]
    assert errors[0] == errors[1] and errors[0] is not None
    assert all(word in errors[0] for word in words), errors[0]


def test_lora_bias_on_a_row_parallel_layer_is_refused(lora: list[dict[str, LoraResult]]) -> None:
    errors = [by_case["row_bias"].error for by_case in lora]
    assert errors[0] == errors[1] and errors[0] is not None
    assert "lora_bias=True" in errors[0] and "o_proj" in errors[0]


def test_lora_on_a_boundary_made_by_parallelize_is_refused(lora: list[dict[str, LoraResult]]) -> None:
    errors = [by_case["lm_head_after_parallelize"].error for by_case in lora]
    assert errors[0] == errors[1] and errors[0] is not None
    assert errors[0].startswith("lm_head:") and "call get_peft_model before parallelize" in errors[0]


def test_save_pretrained_writes_a_normal_adapter_that_peft_loads_on_one_process(lora: list[dict]) -> None:
    for by_case in lora:
        life = by_case["llama_parallelize_first"].lifecycle
        assert life["saved_shapes_match"] and life["saved_config"] == "LORA"
        err, tol = life["save"]
        assert err <= tol, f"{err} > {tol}"


def test_an_adapter_saved_on_one_process_loads_onto_a_parallelized_base(lora: list[dict[str, LoraResult]]) -> None:
    for by_case in lora:
        err, tol = by_case["llama_parallelize_first"].lifecycle["load"]
        assert err <= tol, f"{err} > {tol}"


def test_merge_and_unload_gives_the_slices_of_the_unsharded_merge(lora: list[dict[str, LoraResult]]) -> None:
    for by_case in lora:
        life = by_case["llama_parallelize_first"].lifecycle
        checked, failures = life["merge"]
        assert checked > 20 and not failures, failures
        err, tol = life["merge_logits"]
        assert err <= tol, f"{err} > {tol}"


def test_dcp_of_the_trainable_state_resumes_training(lora: list[dict[str, LoraResult]]) -> None:
    for by_case in lora:
        kept_going, resumed = by_case["llama_parallelize_first"].lifecycle["dcp"]
        assert len(resumed) == 3
        assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(kept_going, resumed)), (kept_going, resumed)


@pytest.mark.parametrize("case", ["dropout", "dropout_peft_first"])
def test_lora_dropout_draws_one_mask_on_a_replicated_input_and_its_own_on_a_shard(
    lora: list[dict[str, LoraResult]], case: str
) -> None:
    first, second = (by_case[case].masks for by_case in lora)
    assert len(first) == 14 and first.keys() == second.keys()  # 2 layers x 7 projections
    for name, mask in first.items():
        assert 0 < sum(mask) < len(mask), f"{name}: p=0.5 dropped nothing or everything"
        if name.split(".")[-3] in COLUMN:
            assert mask == second[name], f"{name}: a replicated input dropped differently on the ranks"
        else:
            assert mask != second[name], f"{name}: a sharded input dropped with one mask on every rank"
    assert lora[0][case].losses == lora[1][case].losses
