"""What is particular to the Llama rows of the parity table (``parity_table.PARITY``)."""

from __future__ import annotations


def test_sequence_parallel_shards_the_residual_stream(parity: list[dict]) -> None:
    # 7 tokens on 2 ranks: the first decoder layer hands on 4 and 3 (torch.tensor_split)
    assert [by_case["llama_tp_sp"].residual_len for by_case in parity] == [4, 3]
    assert [by_case["llama_tp_sp_layers"].residual_len for by_case in parity] == [4, 3]
    assert [by_case["llama_tp"].residual_len for by_case in parity] == [7, 7]


def test_each_layer_gets_the_class_of_its_contract(parity: list[dict]) -> None:
    for by_case in parity:
        assert by_case["llama_tp_sp_layers"].layer_classes == ["LlamaDecoderLayer", "LlamaDecoderLayer_hp1"]
        assert by_case["llama_tp"].layer_classes == ["LlamaDecoderLayer", "LlamaDecoderLayer"]


def test_tied_embeddings_stay_tied(parity: list[dict]) -> None:
    assert all(by_case["llama_tp_vocab_tied"].tied for by_case in parity)


def test_sharded_parameters_take_less_memory(parity: list[dict]) -> None:
    for by_case in parity:
        tp, vocab = by_case["llama_tp"], by_case["llama_tp_vocab_toggle"]
        assert tp.local_bytes < tp.full_bytes
        assert vocab.local_bytes < tp.local_bytes  # embedding and lm_head sharded too
