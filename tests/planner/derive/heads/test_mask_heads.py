"""An attention whose ``attention_mask`` carries ALiBi's per-head bias stays whole (:meth:`HeadRules.check_mask_heads`).

Falcon with ``alibi=True`` (falcon-rw-1b's shape) adds the bias, made by the model for all heads, into the mask
it hands every attention (``[batch, heads, q, k]``). Sharding the heads left every rank adding all heads' bias:
on transformers 5.25 the plan crashed at run time (``The size of tensor a (2) must match the size of tensor b
(4)``). The plan keeps the attention whole and says why; the MLP is still sharded. Planned on the meta device.
"""

from __future__ import annotations

from typing import Any


def _plan(**config: Any) -> dict[str, Any]:
    from transformers import FalconConfig

    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    model = meta_model(FalconConfig(num_hidden_layers=2, vocab_size=127, hidden_size=64, num_attention_heads=4, **config))
    return plan_model(model, tp=2, name="falcon")


def test_alibi_in_the_mask_keeps_the_attention_whole() -> None:
    plan = _plan(multi_query=False, alibi=True, parallel_attn=False)
    assert "transformer.h.*.self_attention" not in plan["param_plan"]
    why = plan["comments"]["replicated"]["transformer.h.*.self_attention.query_key_value"]
    assert "attention_mask" in why and "ALiBi" in why and "4 heads" in why, why
    assert "transformer.h.*.mlp" in plan["param_plan"]  # the rest of the layer is still sharded


def test_without_alibi_the_mask_does_not_matter() -> None:
    plan = _plan(multi_query=False, alibi=False, parallel_attn=False)
    assert plan["param_plan"]["transformer.h.*.self_attention"]["params"]["query_key_value.weight"]["tp"].startswith("S")
