"""``--sp`` rules (:mod:`hpgen.planner.translate.sequence_parallel`): what a decoder layer splits on entry."""

from __future__ import annotations

from typing import Any


def _sp_plan(model_type: str) -> dict[str, Any]:
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model
    from hpgen.verify.shrink import tiny_config

    return plan_model(meta_model(tiny_config(model_type)), tp=2, sp=True, name=model_type)


def _layers(plan: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    """The plan's entries of the decoder layers themselves (``prefix`` + index or ``*``)."""
    entries = plan["param_plan"].items()
    return {key: entry for key, entry in entries if key.startswith(prefix) and "." not in key[len(prefix) :]}


def test_a_per_position_argument_the_layer_computes_with_is_split_at_every_layer() -> None:
    # Gemma 4: the model computes per_layer_input [batch, sequence, ...] for the whole sequence, and each layer
    # multiplies its sequence shard by it; position_embeddings and the mask go only to the attention, which
    # gathers the sequence first, so they stay whole
    layers = _layers(_sp_plan("gemma4_text"), "model.layers.")
    assert len(layers) >= 2
    for key, entry in layers.items():
        assert entry["in_src"]["per_layer_input"] == {"tp": "R"}, key
        assert entry["in_dst"]["per_layer_input"] == {"tp": "S(1)"}, key
        assert set(entry["in_src"]) == {"hidden_states", "per_layer_input"}, key


def test_arguments_handed_only_to_gathering_children_stay_whole() -> None:
    for key, entry in _layers(_sp_plan("llama"), "model.layers.").items():
        assert set(entry["in_src"]) == {"hidden_states"}, key


def test_a_stream_whose_dim_1_is_not_the_positions_is_refused() -> None:
    # Gemma 3n's decoder layers take the AltUp stack [altup, batch, sequence, hidden]: S(1) would cut the batch
    import pytest

    from hpgen.core.errors import HpgenError

    refusal = r"model.layers.0 receives hidden_states as \[4, 3, 7, 64\] .* dim 1 is not the positions"
    with pytest.raises(HpgenError, match=refusal):
        _sp_plan("gemma3n_text")
