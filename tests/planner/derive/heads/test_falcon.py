"""Falcon's attention on the installed transformers: the counts a derived plan divides or counts per rank.

transformers 5.25 moved Falcon to the shared attention interface (``repeat_kv`` by
``num_key_value_groups``); 5.24 reshapes with ``num_heads`` alone. The planner reads whichever
file is installed, so these run under both releases (``hpgen verify`` proves the plans exact:
tests/support/verify_corpus.py's ``FALCON`` cases; Falcon-7B's share per rank is in test_uneven.py).
Plans are built on the meta device: no weights.
"""

from __future__ import annotations

from typing import Any

import pytest


def _attention(plan: dict[str, Any]) -> dict[str, Any]:
    return plan["param_plan"]["transformer.h.*.self_attention"]


def _plan(tp: int = 2, **config: Any) -> tuple[Any, dict[str, Any]]:
    from transformers import FalconConfig

    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    model = meta_model(FalconConfig(**config))
    return model, plan_model(model, tp=tp, name="falcon")


@pytest.mark.parametrize(
    "config",
    [
        {"hidden_size": 64, "num_attention_heads": 8},  # multi-query, head_dim 8 = the head count
        {"hidden_size": 64, "num_attention_heads": 8, "multi_query": False},  # a key/value head per query head
    ],
    ids=["multi_query", "per_head"],
)
def test_a_head_count_equal_to_head_dim_is_still_divided(config: dict[str, Any]) -> None:
    model, plan = _plan(num_hidden_layers=2, vocab_size=127, **config)
    attention = model.transformer.h[0].self_attention
    divided = set(_attention(plan).get("tp_divide_attrs", []))
    assert "num_heads" in divided
    if config.get("multi_query", True) and hasattr(attention, "num_key_value_groups"):
        assert "num_key_value_groups" in divided


def test_grouped_heads_divide_their_key_value_groups() -> None:
    # new_decoder_architecture: [each group's queries | key | value], cut by whole groups
    model, plan = _plan(num_hidden_layers=2, vocab_size=127, hidden_size=64, num_attention_heads=8,
                        new_decoder_architecture=True, num_kv_heads=2)  # fmt: skip
    entry = _attention(plan)
    assert entry["params"]["query_key_value.weight"] == {"tp": "S(0)"}
    assert "num_kv_heads" in entry["tp_divide_attrs"]
    assert "num_key_value_groups" not in entry["tp_divide_attrs"]  # 4 query heads per group on every rank
