"""Deriving a plan from the modeling source: which modules become boundaries of which kind, the placements, the notes (:mod:`hpgen.planner.derive.derivation`, :mod:`hpgen.planner.derive.group_blocks`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.derived_configs import tiny
from tests.planner.plan_helpers import derived, entry


def test_gpt2_conv1d_and_the_fused_qkv() -> None:
    plan = derived("gpt2")
    attn = entry(plan, "transformer.h.*.attn")
    # Conv1D weights are [in, out]: the column-parallel c_attn shards dim 1, in three packed Q|K|V blocks
    assert attn["params"]["c_attn.weight"] == {"tp": "SS(1,3)"}
    assert attn["params"]["c_attn.bias"] == {"tp": "SS(0,3)"}
    assert attn["params"]["c_proj.weight"] == {"tp": "S(0)"}  # row-parallel: the input dim, dim 0
    assert attn["deferred_bias_params"] == ["c_proj.bias"]
    assert attn["tp_divide_attrs"] == ["split_size"]  # split(self.split_size) cuts the local Q|K|V
    assert attn["out_src"] == {"attn_output": {"tp": "P(sum)"}} and attn["out_dst"] == {"attn_output": {"tp": "R"}}
    mlp = entry(plan, "transformer.h.*.mlp")
    assert mlp["params"]["c_fc.weight"] == {"tp": "S(1)"} and mlp["params"]["c_proj.weight"] == {"tp": "S(0)"}
    assert entry(plan, "transformer.wte")["params"] == {"weight": {"tp": "S(0)"}}
    assert plan["comments"]["plan_source"] == "derived from the source"


def test_gpt_neox_interleaved_qkv_keeps_whole_heads() -> None:
    plan = derived("gpt_neox")
    attention = entry(plan, "gpt_neox.layers.*.attention")
    # view(..., heads, 3 * head_dim): [h, 3, d] per head, so a plain row shard holds whole heads
    assert attention["params"]["query_key_value.weight"] == {"tp": "S(0)"}
    assert attention["params"]["dense.weight"] == {"tp": "S(1)"}
    assert entry(plan, "gpt_neox.layers.*.mlp")["params"]["dense_h_to_4h.weight"] == {"tp": "S(0)"}


def test_opt_mlp_in_the_decoder_layer_becomes_two_wrapped_linears() -> None:
    plan = derived("opt")
    # the attention returns out_proj's output alone: one block
    attention = entry(plan, "model.decoder.layers.*.self_attn")
    assert attention["in_src"] == {"hidden_states": {"tp": "R"}}
    assert attention["tp_divide_attrs"] == ["num_heads"]
    # fc1/fc2 sit in the decoder layer itself, between residual adds: each its own boundary
    fc1, fc2 = entry(plan, "model.decoder.layers.*.fc1"), entry(plan, "model.decoder.layers.*.fc2")
    assert fc1["out_src"] == fc1["out_dst"] == {"output": {"tp": "S(-1)"}}
    assert fc2["in_src"] == fc2["in_dst"] == {"input": {"tp": "S(-1)"}}
    assert fc2["out_src"] == {"output": {"tp": "P(sum)"}} and fc2["deferred_bias_params"] == ["bias"]


def test_bert_self_attention_keeps_its_output_sharded_for_the_dense_after_it() -> None:
    plan = derived("bert")
    self_attention = entry(plan, "bert.encoder.layer.*.attention.self")
    assert self_attention["out_src"] == self_attention["out_dst"] == {"output_0": {"tp": "S(-1)"}} or all(
        value == {"tp": "S(-1)"} for value in self_attention["out_dst"].values()
    )
    assert entry(plan, "bert.encoder.layer.*.attention.output.dense")["in_dst"] == {"input": {"tp": "S(-1)"}}
    # the output projection's bias is also registered as cls.predictions.bias: both shard alike
    assert entry(plan, "cls.predictions")["params"] == {"bias": {"tp": "S(0)"}}
    assert entry(plan, "cls.predictions.decoder")["params"]["bias"] == {"tp": "S(0)"}


@pytest.mark.parametrize(
    ("family", "module", "reason"),
    [
        ("gpt_bigcode", "transformer.h.*.attn.c_attn", "unequal sizes [64, 16, 16]"),
    ],
)
def test_what_cannot_shard_stays_replicated_and_says_why(family: str, module: str, reason: str) -> None:
    plan = derived(family)
    assert reason in plan["comments"]["replicated"][module]
    assert not any(key.endswith(("self_attention", ".attn")) for key in plan["param_plan"])
    assert any(".mlp" in key for key in plan["param_plan"])  # the MLP still shards


def test_a_chunked_feed_forward_returns_only_its_result() -> None:
    plan = derived("xmod")  # apply_chunking_to_forward(self.feed_forward_chunk, ..., attention_output)
    assert entry(plan, "roberta.encoder.layer.*.intermediate.dense")["out_dst"] == {"output": {"tp": "S(-1)"}}
    assert entry(plan, "roberta.encoder.layer.*.output.dense")["params"]["weight"] == {"tp": "S(1)"}


def test_classes_under_a_module_level_if_are_read_and_left_to_wrapped_leaves() -> None:
    plan = derived("xlstm")  # hpgen lower rewrites top-level classes only: no block on xLSTMFeedForward
    assert "backbone.blocks.*.ffn" not in plan["param_plan"]
    for name in ("proj_up", "proj_up_gate"):
        assert entry(plan, f"backbone.blocks.*.ffn.{name}")["out_dst"] == {"output": {"tp": "S(-1)"}}
    assert entry(plan, "backbone.blocks.*.ffn.proj_down")["params"]["weight"] == {"tp": "S(1)"}


def test_layers_from_another_modeling_file_shard_as_wrapped_leaves() -> None:
    plan = derived("fuyu")  # FuyuForCausalLM's file has no layers: Persimmon's file is read, not rewritten
    mlp = "model.language_model.layers.*.mlp"
    assert mlp not in plan["param_plan"]
    assert entry(plan, f"{mlp}.dense_h_to_4h")["out_dst"] == {"output": {"tp": "S(-1)"}}
    assert entry(plan, f"{mlp}.dense_4h_to_h")["params"]["weight"] == {"tp": "S(1)"}
    # the attention's per-head q/k layernorms need a block to reduce their gradients in: not in this file
    assert "needs a block" in plan["comments"]["replicated"]["model.language_model.layers.*.self_attn.dense"]


def test_a_norm_across_the_sharded_features_leaves_the_pair_replicated() -> None:
    plan = derived("bitnet")  # BitNet normalises the attention output (attn_sub_norm) before o_proj
    assert "model.layers.*.self_attn.o_proj" in plan["comments"]["replicated"]
    # only the MLP's down_proj (89 -> 64, wider in than out) is sharded: a row on its split replicated input
    assert set(plan["param_plan"]) == {"model.embed_tokens", "lm_head", "model.layers.*.mlp.down_proj"}
    assert plan["param_plan"]["model.layers.*.mlp.down_proj"]["in_dst"] == {"input": {"tp": "S(-1)"}}


def test_derived_plans_load_and_lower() -> None:
    import inspect

    from hpgen.generator.generate import infer_package
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.model.load import model_class_for

    for family in ("gpt2", "opt", "bert"):
        source = Path(inspect.getsourcefile(model_class_for(tiny(family))) or "")
        text = lower(
            source.read_text(), plan_from_dict(derived(family)), source_name=source.name, package=infer_package(source)
        )
        assert "_hp_tp" in text


def test_a_grouped_linear_is_not_sharded_as_a_linear() -> None:
    """A ``nn.Linear`` subclass whose forward reshapes its weight (DeepSeek-V4's block-diagonal o_a_proj)."""
    import torch
    from torch import nn

    from hpgen.planner.derive.split_rows import reshapes_weight

    class Grouped(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.weight.view(2, -1, x.shape[-1]).transpose(1, 2)
            return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    assert reshapes_weight(Grouped(4, 4, device="meta"))
    assert not reshapes_weight(Scaled(4, 4, device="meta")) and not reshapes_weight(nn.Linear(4, 4, device="meta"))
