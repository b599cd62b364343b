"""Llama parallelized over 2 gloo ranks against the unsharded transformers model.

One spawn of 2 processes runs every variant (see ``CASES``); each test then checks one
property of one variant on both ranks: logits, every parameter's gradient (the local
slice of the reference gradient), and 12 greedily generated tokens with the KV cache.
"""

from __future__ import annotations

import pytest

from tests.dist import run_distributed
from tests.runtime.models import (
    Case,
    check_generation,
    check_gradients,
    check_logits,
    check_state_dict_keys,
    load_plan_dict,
    lower_family,
    run_cases,
)

# name: (plan in tests/plans, config overrides, lowering mode)
CASES = {
    # the example plan of the contract, as written there (no o_proj bias: Llama has none):
    # lm_head and embed_tokens declare no input, the wrapper copies lm_head's in itself
    "spec_example": ("llama_spec", {}, "default"),
    # attention heads and MLP columns/rows sharded, one all-reduce each
    "tp": ("llama_tp", {}, "default"),
    # + vocab-parallel embed_tokens and column-parallel lm_head, sharing one tied weight
    "tp_vocab_tied": ("llama_tp_vocab", {"tie_word_embeddings": True}, "default"),
    # the same from a file lowered in toggle mode (``if self.tp_enable:`` blocks)
    "tp_vocab_toggle": ("llama_tp_vocab", {}, "toggle"),
    # + sequence parallel residual stream: 2 all-gathers and 2 reduce-scatters per layer
    "tp_sp": ("llama_tp_sp", {}, "default"),
    # the same with the gather in the last decoder layer: that layer gets the generated
    # subclass LlamaDecoderLayer_hp1 (a second contract of the class)
    "tp_sp_layers": ("llama_tp_sp_layers", {}, "default"),
    # q/k/v and gate/up biases sharded, o_proj and down_proj biases deferred
    "bias": ("llama_bias", {"attention_bias": True, "mlp_bias": True}, "default"),
    # attention in the generic form (an input in **kwargs), lm_head through DTensor R -> P
    "generic": ("llama_generic", {}, "default"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = tmp_path_factory.mktemp("llama")
    cases = []
    for name, (plan, config, mode) in CASES.items():
        generated = lower_family("llama", plan, directory, mode=mode)
        cases.append(Case(name, "llama", str(generated), load_plan_dict(plan), config))
    return run_distributed(run_cases, cases, timeout=300)


@pytest.mark.parametrize("name", CASES)
def test_logits(results: list[dict], name: str) -> None:
    check_logits(results, name)


@pytest.mark.parametrize("name", CASES)
def test_state_dict_keys_unchanged(results: list[dict], name: str) -> None:
    check_state_dict_keys(results, name)


@pytest.mark.parametrize("name", CASES)
def test_gradients(results: list[dict], name: str) -> None:
    check_gradients(results, name)


@pytest.mark.parametrize("name", CASES)
def test_greedy_generation(results: list[dict], name: str) -> None:
    check_generation(results, name)


def test_sequence_parallel_shards_the_residual_stream(results: list[dict]) -> None:
    # 7 tokens on 2 ranks: the first decoder layer hands on 4 and 3 (torch.tensor_split)
    assert [by_case["tp_sp"].residual_len for by_case in results] == [4, 3]
    assert [by_case["tp_sp_layers"].residual_len for by_case in results] == [4, 3]
    assert [by_case["tp"].residual_len for by_case in results] == [7, 7]


def test_each_layer_gets_the_class_of_its_contract(results: list[dict]) -> None:
    for by_case in results:
        assert by_case["tp_sp_layers"].layer_classes == ["LlamaDecoderLayer", "LlamaDecoderLayer_hp1"]
        assert by_case["tp"].layer_classes == ["LlamaDecoderLayer", "LlamaDecoderLayer"]


def test_tied_embeddings_stay_tied(results: list[dict]) -> None:
    assert all(by_case["tp_vocab_tied"].tied for by_case in results)


def test_sharded_parameters_take_less_memory(results: list[dict]) -> None:
    for by_case in results:
        tp, vocab = by_case["tp"], by_case["tp_vocab_toggle"]
        assert tp.local_bytes < tp.full_bytes
        assert vocab.local_bytes < tp.local_bytes  # embedding and lm_head sharded too
