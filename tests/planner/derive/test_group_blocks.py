"""The placements of a group's projections (:mod:`hpgen.planner.derive.group_blocks`): a row-parallel bias is
deferred (added once after the reduction), which ``parallelize`` does by taking it out of ``nn.Linear.forward``.

A subclass with a ``forward`` of its own (Falcon's ``FalconLinear``, ``bias=True`` as falcon-rw has it) cannot be
changed so: the plan used to defer its bias anyway and ``parallelize`` refused it at run time. The group stays
whole, and the plan says why. Planned on the meta device; runs on whichever transformers is installed.
"""

from __future__ import annotations

from typing import Any


def _plan(bias: bool) -> dict[str, Any]:
    from transformers import FalconConfig

    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    config = FalconConfig(num_hidden_layers=2, vocab_size=127, hidden_size=64, num_attention_heads=4, bias=bias)
    return plan_model(meta_model(config), tp=2, name="falcon")


def test_a_row_bias_of_a_linear_with_its_own_forward_keeps_the_group_whole() -> None:
    plan = _plan(bias=True)
    for key in ("transformer.h.*.self_attention", "transformer.h.*.mlp"):
        assert key not in plan["param_plan"], key
    why = plan["comments"]["replicated"]["transformer.h.*.mlp.dense_h_to_4h"]
    assert "dense_4h_to_h (FalconLinear) overrides nn.Linear.forward and has a bias" in why, why


def test_without_a_bias_the_same_groups_shard() -> None:
    plan = _plan(bias=False)
    assert plan["param_plan"]["transformer.h.*.mlp"]["params"]["dense_4h_to_h.weight"] == {"tp": "S(1)"}
    assert "transformer.h.*.self_attention" in plan["param_plan"]
