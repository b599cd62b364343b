"""Matrices read per head between the projections: per-head scales, shared maps, taps (:mod:`hpgen.planner.derive.heads.per_head_params`, :mod:`hpgen.planner.derive.heads.maps`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.derived_configs import tiny
from tests.planner.plan_helpers import entry, placements


HEAD_MAP_SOURCE = '''
import torch
from torch import nn
import torch.nn.functional as F


class RelativeLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(8, 12))

    def forward(self, states, positions):
        logits = (states @ self.proj).transpose(1, 2)
        index = positions.clamp(0, 11).expand(*logits.shape[:2], -1, -1)
        return logits.gather(-1, index)


class SummedLogits(RelativeLogits):
    def forward(self, states, positions):
        logits = (states @ self.proj).sum(2, keepdim=True).transpose(1, 2)
        return logits.gather(-1, positions.clamp(0, 11).expand(*logits.shape[:2], -1, -1))


class ShortConv(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1d = nn.Conv1d(channels, channels, 3, groups=channels, bias=False)

    def forward(self, x):
        out = F.conv1d(x.transpose(1, 2), self.conv1d.weight, padding=2, groups=x.shape[-1])
        return x + out[..., : x.shape[1]].transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.num_heads = 4
        self.head_dim = 16
        self.q_proj = nn.Linear(64, 64, bias=False)
        self.k_proj = nn.Linear(64, 64, bias=False)
        self.v_proj = nn.Linear(64, 64, bias=False)
        self.r_proj = nn.Linear(64, 4 * 8, bias=False)
        self.k_conv = ShortConv(128 if variant == "conv_over_k_and_v" else 64)
        self.rel = SummedLogits() if variant == "sums_heads" else RelativeLogits()
        self.o_proj = nn.Linear(64, 64, bias=False)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, -1, 16).transpose(1, 2)
        if self.variant == "conv_over_k_and_v":
            k, v = self.k_conv(torch.cat([self.k_proj(hidden_states), self.v_proj(hidden_states)], -1)).chunk(2, -1)
        else:
            k, v = self.k_conv(self.k_proj(hidden_states)), self.v_proj(hidden_states)
        k = k.view(b, s, -1, 16).transpose(1, 2)
        v = v.view(b, s, -1, 16).transpose(1, 2)
        r = self.r_proj(hidden_states).view(b, s, self.num_heads, -1)
        positions = torch.arange(s)[:, None] - torch.arange(s)[None, :]
        bias = self.rel(r, positions[None, None])
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.attn = Attention(variant)

    def forward(self, hidden_states):
        return hidden_states + self.attn(hidden_states)


class Model(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.layers = nn.ModuleList([Layer(variant) for _ in range(2)])

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states
'''


@pytest.mark.parametrize("variant", ["per_head", "sums_heads", "conv_over_k_and_v"])
def test_a_per_head_matrix_and_a_short_conv_on_one_column_follow_the_heads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    """A leaf applying one ``[d_rel, e]`` matrix to each head's features (``r.view(..., heads, -1) @ proj``,
    d_rel 8, not the head size) runs on this rank's heads with the whole matrix, its gradient reduced; a
    depthwise conv over one column's output alone is ``S(0)``. A leaf that sums over the heads, or a conv
    over ``cat([k, v])`` (no split says its blocks), leaves the attention replicated."""
    import importlib.util

    from hpgen.planner.derive.derivation import derive

    path = tmp_path / "head_map_model.py"
    path.write_text(HEAD_MAP_SOURCE)
    spec = importlib.util.spec_from_file_location("head_map_model", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(__import__("sys").modules, "head_map_model", module)  # inspect finds the classes' file
    spec.loader.exec_module(module)
    derivation = derive(module.Model(variant), tp=2, source=path)
    notes = {note.target: note.text for note in derivation.notes if not note.sharded}
    if variant == "per_head":
        block = derivation.placed["layers.0.attn"]
        assert placements(block) == {
            "q_proj.weight": "S(0)", "k_proj.weight": "S(0)", "v_proj.weight": "S(0)", "r_proj.weight": "S(0)",
            "o_proj.weight": "S(1)", "k_conv.conv1d.weight": "S(0)",
        }
        assert block.grad_reduce == {"rel.proj"}
        assert block.divide == {"num_heads"}
    elif variant == "sums_heads":
        assert "layers.0.attn" not in derivation.placed
        assert notes["layers.*.attn.o_proj"] == "not part of a column -> row pair: kept replicated"
    else:
        assert "layers.0.attn" not in derivation.placed
        assert "k_conv.conv1d.weight (128, 1, 3) directly, which does not follow the shards" in notes[
            "layers.*.attn.o_proj"
        ]


def test_inkling2_attention_is_completed_with_its_per_head_scales_taps_and_shared_map() -> None:
    """transformers' plan shards Inkling2's experts only; the derivation adds the attention. The sliding
    layer's L2-clip scales ``[heads, d]`` (leaves over per-head views) and the full layer's (read directly)
    shard by head; the relative-position matrix ``[d_rel, extent]`` (``x @ proj``, one map for every head)
    stays whole with its gradient reduced; the dynamic convolutions' static taps ``[kernel, channels]`` shard
    their channels and ``weight_proj`` (``view(b, s, heads, 1, kernel)``) its heads; ``num_heads`` is divided,
    ``conv_kernel_size`` (4, as many as the heads, but sized within a head) is not. The relative-position
    projection's 16 rows are its module's 4 heads of ``d_rel`` 4, which divide over 2 ranks (not one head of
    the attention's head_dim 16)."""
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    plan = plan_model(meta_model(tiny("inkling2")), tp=2, name="inkling2")
    assert plan["comments"]["plan_source"] == "transformers' plan"
    sliding, full = (entry(plan, f"model.layers.{i}.self_attn") for i in (0, 1))
    for block in (sliding, full):
        params = {name: layout["tp"] for name, layout in block["params"].items()}
        assert params["q_proj.norm.scale"] == params["relative_position_bias.norm.scale"] == "S(0)"
        assert params["sink_proj.weight"] == params["o_proj.gate_proj.weight"] == "S(0)"
        assert params["o_proj.linear.weight"] == "S(1)"
        assert block["grad_reduce_params"] == ["relative_position_bias.proj"]
    assert {n: sliding["params"][n]["tp"] for n in ("k_proj.sconv.conv1d.weight", "v_proj.sconv.conv1d.weight")} == {
        "k_proj.sconv.conv1d.weight": "S(0)", "v_proj.sconv.conv1d.weight": "S(0)",
    }
    for side in ("k", "v"):
        assert full["params"][f"{side}_proj.sconv.static_weight"] == {"tp": "S(1)"}
        assert full["params"][f"{side}_proj.sconv.weight_proj.weight"] == {"tp": "S(0)"}
        assert entry(plan, f"model.layers.1.self_attn.{side}_proj.sconv")["tp_divide_attrs"] == ["num_heads"]
    assert entry(plan, "model.layers.*.self_attn.relative_position_bias")["tp_divide_attrs"] == ["num_heads"]
