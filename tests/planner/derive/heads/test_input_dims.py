"""The meta-device forward the planner reads shapes from (:mod:`hpgen.planner.derive.heads.input_dims`)."""

from __future__ import annotations


def test_a_moe_model_runs_on_the_meta_device_and_keeps_its_experts_implementation() -> None:
    # transformers' default experts path asks which experts got tokens (.item(): no data on the meta device) or
    # wants bfloat16 there; the forward runs its experts as batched_mm and sets the choice back
    import pytest

    from hpgen.planner.derive.heads.input_dims import meta_forward, recorded_arguments
    from hpgen.planner.model.load import meta_model
    from hpgen.verify.shrink import tiny_config

    for model_type in ("qwen3_moe", "gpt_oss"):
        model = meta_model(tiny_config(model_type))
        chosen = model.config._experts_implementation
        meta_forward(model, 3, 7)
        assert model.config._experts_implementation == chosen, model_type
        layer = type(model.model.layers[0])
        recorded = recorded_arguments(model, frozenset({layer}), 3, 7)
        assert not isinstance(recorded, str), recorded
        assert recorded["model.layers.0"][0]["hidden_states"] == (3, 7, model.config.hidden_size)
    with pytest.raises(RuntimeError, match="does not run on the meta device"):
        meta_forward(meta_model(tiny_config("xlnet")), 3, 7)  # a model that needs data: the cause, in one line
