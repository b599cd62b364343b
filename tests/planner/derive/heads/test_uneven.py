"""``hpgen plan`` where the heads do not divide ``--tp``: whole heads per rank, multi-query Falcon, the refusal.

Configs are written to a temporary folder and built on the meta device: nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hpgen.cli import cli
from tests.planner.plan_helpers import derived, entry


def _plan(tmp_path, config, *args):
    folder = tmp_path / "cfg"
    config.save_pretrained(folder)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["plan", str(folder), "-o", str(out), *map(str, args)], catch_exceptions=False)
    return result, out


def _entry(plan, suffix):
    (key,) = [k for k in plan["param_plan"] if k.endswith(suffix)]
    return plan["param_plan"][key]


def _tp(entry):
    return {name: layout["tp"] for name, layout in entry["params"].items()}


def test_qwen25_7b_at_tp_8_cuts_each_key_value_groups_query_heads_4_and_3(tmp_path):
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    )
    result, out = _plan(tmp_path, config, "--tp", 8)
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["format"] == "hpgen.plan/2"
    attention = _entry(plan, "self_attn")
    assert _tp(attention) == {
        "q_proj.weight": "S(0,128,4)",
        "q_proj.bias": "S(0,128,4)",
        "k_proj.weight": "RS(0,2)",
        "k_proj.bias": "RS(0,2)",
        "v_proj.weight": "RS(0,2)",
        "v_proj.bias": "RS(0,2)",
        "o_proj.weight": "S(1,128,4)",
    }
    assert attention["local_attrs"] == {
        "num_key_value_groups": {
            "of": "q_proj.weight",
            "dim": 0,
            "unit": 128,
            "per": {"of": "k_proj.weight", "dim": 0, "unit": 128},
        }
    }
    assert "divide_attrs" not in attention
    assert "query heads per rank 4, 3, 4, 3, 4, 3, 4, 3 of 28; key/value heads 1, 1, 1, 1, 1, 1, 1, 1 of 4" in (
        result.stderr
    )
    assert "the busiest rank computes 0.143 of the attention (even: 0.125)" in result.stderr


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "query", "keys", "held"),
    [
        (14, 2, 4, "S(0,16,2)", "RS(0,2)", "4, 3, 4, 3 of 14"),  # Qwen2-0.5B-shaped
        (6, 6, 4, "S(0,16)", "S(0,16)", "2, 2, 1, 1 of 6"),  # multi-head: whole heads, the first ranks one more
        (12, 4, 3, "S(0,48)", "S(0,16)", "6, 3, 3 of 12"),  # whole GQA groups: 2/1/1 key/value heads
    ],
)
def test_heads_that_do_not_divide_are_cut_whole(tmp_path, heads, kv, tp, query, keys, held):
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=16 * heads,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=128,
    )
    result, out = _plan(tmp_path, config, "--tp", tp)
    assert result.exit_code == 0, result.output
    attention = _entry(json.loads(out.read_text()), "self_attn")
    params = _tp(attention)
    assert (params["q_proj.weight"], params["k_proj.weight"], params["v_proj.bias"]) == (query, keys, keys)
    assert params["o_proj.weight"] == query.replace("S(0", "S(1")
    assert ("local_attrs" in attention) == (kv < tp)  # the groups per rank differ only where key/value heads replicate
    assert f"query heads per rank {held}" in result.stderr


def test_a_tp_that_leaves_a_rank_without_a_query_head_is_refused_in_one_line(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=96, intermediate_size=64, num_hidden_layers=1, num_attention_heads=6, vocab_size=64)
    result, out = _plan(tmp_path, config, "--tp", 8)
    assert result.exit_code == 2
    assert not out.exists()
    (line,) = result.stderr.strip().splitlines()
    assert "--tp 8 leaves a rank with no query head: num_attention_heads=6" in line


def test_multi_query_falcon_7b_shards_its_query_heads_and_reduces_once_a_layer(tmp_path):
    from transformers import FalconConfig

    result, out = _plan(tmp_path, FalconConfig(), "--tp", 2)  # the default config: Falcon-7B's shape
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    attention = _entry(plan, "self_attention")
    assert _tp(attention) == {"query_key_value.weight": "B(0,4544:S(0,64),64:R,64:R)", "dense.weight": "S(1,64)"}
    counted = {"of": "dense.weight", "dim": 1, "unit": 64}  # each rank's query heads: 36 and 35
    expected = {"num_heads": counted}
    if _reads_key_value_groups():  # transformers 5.25: repeat_kv repeats the one key/value head per rank
        expected["num_key_value_groups"] = counted
    assert attention["local_attrs"] == expected
    layer = plan["param_plan"]["transformer.h.*"]
    assert set(layer["summed_reduction"]["branches"]) == {"self_attention", "mlp"}
    assert "query heads per rank 36, 35 of 71" in result.stderr
    share = float(result.stderr.split("of the model)")[0].rsplit("(", 1)[1])
    assert share <= 0.52


@pytest.mark.parametrize(
    ("options", "heads", "tp", "qkv"),
    [
        ({}, 8, 2, "B(0,128:S(0),16:R,16:R)"),  # multi-query, heads dividing
        ({}, 7, 2, "B(0,112:S(0,16),16:R,16:R)"),
        ({"new_decoder_architecture": True, "num_kv_heads": 1}, 7, 2, "B(0,112:S(0,16),16:R,16:R)"),
        ({"new_decoder_architecture": True, "num_kv_heads": 7}, 7, 3, "S(0,48)"),  # whole key/value groups
        ({"multi_query": False}, 7, 2, "S(0,48)"),  # per head [q k v] interleaved: whole heads
    ],
)
def test_falcon_attention_is_sharded_whatever_its_heads(options, heads, tp, qkv):
    from transformers import FalconConfig

    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    config = FalconConfig(hidden_size=16 * heads, num_attention_heads=heads, num_hidden_layers=1, vocab_size=64, **options)
    plan = plan_model(meta_model(config), tp=tp)
    attention = _entry(plan, "self_attention")
    assert _tp(attention)["query_key_value.weight"] == qkv
    assert _tp(attention)["dense.weight"] == ("S(1)" if heads % tp == 0 else "S(1,16)")
    assert "summed_reduction" in plan["param_plan"]["transformer.h.*"]


def test_a_fused_projection_transformers_plan_shards_whole_is_derived_from_the_source_where_heads_do_not_divide():
    """GPT-NeoX's query_key_value is colwise in transformers' plan; only the source says it is per-head [q k v]."""
    from transformers import GPTNeoXConfig

    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    config = GPTNeoXConfig(hidden_size=96, num_attention_heads=6, num_hidden_layers=1, intermediate_size=64, vocab_size=64)
    plan = plan_model(meta_model(config), tp=4)
    assert plan["comments"]["plan_source"] == "derived from the source"
    assert "query_key_value" in plan["comments"]["derived_because"]
    attention = _entry(plan, "attention")
    assert _tp(attention)["query_key_value.weight"] == "S(0,48)" and _tp(attention)["dense.weight"] == "S(1,16)"


def test_the_derivation_refuses_a_tp_that_leaves_a_rank_without_a_query_head():
    from transformers import FalconConfig

    from hpgen.core.errors import HpgenError
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    config = FalconConfig(hidden_size=48, num_attention_heads=3, num_hidden_layers=1, vocab_size=64)
    with pytest.raises(HpgenError, match="--tp 4 leaves a rank with no query head: num_attention_heads=3"):
        plan_model(meta_model(config), tp=4, name="falcon")


def test_heads_that_do_not_divide_are_cut_whole_by_the_derivation() -> None:
    plan = derived("opt", tp=3)  # 4 heads of 16 on 3 ranks: 2, 1, 1
    attention = entry(plan, "model.decoder.layers.*.self_attn")
    assert attention["params"]["q_proj.weight"] == attention["params"]["v_proj.bias"] == {"tp": "S(0,16)"}
    assert attention["params"]["out_proj.weight"] == {"tp": "S(1,16)"}
    # each rank's num_heads, counted from its shard of out_proj's input in heads of 16
    assert attention["local_attrs"] == {"num_heads": {"of": "out_proj.weight", "dim": 1, "unit": 16}}
    assert "tp_divide_attrs" not in attention and plan["format"] == "hpgen.plan/2"


def _reads_key_value_groups() -> bool:
    """Whether the installed Falcon attention has ``num_key_value_groups`` (transformers' attention interface)."""
    from transformers import FalconConfig
    from transformers.models.falcon.modeling_falcon import FalconAttention

    return hasattr(FalconAttention(FalconConfig(hidden_size=64, num_attention_heads=4), 0), "num_key_value_groups")
