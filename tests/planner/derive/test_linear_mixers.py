"""A linear-attention mixer's depthwise conv and per-head tensors (:mod:`hpgen.planner.derive.linear_mixers`)."""

from __future__ import annotations

from tests.planner.plan_helpers import derived, entry


def test_a_linear_attention_mixer_shards_its_conv_and_per_head_tensors_with_the_heads() -> None:
    """Kimi Linear's KDA: q/k/v, the gates' up-projections and b_proj are columns; the depthwise conv over
    ``cat([q, k, v])`` is three packed blocks; ``A_log`` ``[1, 1, heads, 1]`` is cut on its head dim; the
    gates' down-projections stay replicated; ``qkv_dim`` (the split sizes) is divided."""
    plan = derived("kimi_linear")
    mixer = entry(plan, "model.layers.0.self_attn")
    params = {name: layout["tp"] for name, layout in mixer["params"].items()}
    assert params["conv1d.weight"] == "SS(0,3)"
    assert params["forget_gate.A_log"] == "S(2)" and params["forget_gate.dt_bias"] == "S(0)"
    assert params["forget_gate.f_b_proj.weight"] == params["b_proj.weight"] == "S(0)"
    assert params["o_proj.weight"] == "S(1)"
    assert {"forget_gate.f_a_proj.weight", "g_a_proj.weight", "o_norm.weight"} <= set(mixer["grad_reduce_params"])
    assert mixer["tp_divide_attrs"] == ["qkv_dim"]


def test_a_conv_over_blocks_of_unequal_sizes_has_no_packed_placement() -> None:
    from types import SimpleNamespace

    import torch
    from torch import nn

    from hpgen.planner.derive.linear_mixers import conv_placement
    from hpgen.planner.flow import Val

    model = nn.Module()
    model.conv = nn.Conv1d(256, 256, 4, groups=256, device="meta")
    name = "conv.weight"

    def split(sizes: list[int]) -> SimpleNamespace:
        value = Val(items=tuple(Val(const=size) for size in sizes))
        return SimpleNamespace(method="split", receiver=frozenset({f"param:{name}"}), arg_vals=(value,))

    weight = model.conv.weight
    assert conv_placement(model, name, weight, [64, 64, 128], [split([64, 64, 128])]) is None
    assert str(conv_placement(model, name, weight, [128, 128], [split([128, 128])])) == "SS(0,2)"
    assert conv_placement(model, name, weight, [128, 128], []) is None  # blocks unknown
    model.conv = nn.Conv1d(256, 256, 4, device="meta")  # mixes channels
    assert conv_placement(model, name, model.conv.weight, [128, 128], [split([128, 128])]) is None
    assert torch.Size([256, 1, 4]) == weight.shape
