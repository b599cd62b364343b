"""Latent down-projections (MLA) kept replicated next to sharded heads (:mod:`hpgen.planner.derive.latent`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.derived_configs import tiny
from tests.planner.plan_helpers import derived, entry, placements


def test_latent_attention_keeps_its_down_projections_replicated_in_the_block() -> None:
    """MLA: ``q_b_proj``/``kv_b_proj`` are the columns; ``kv_a_proj_with_mqa`` (whose rotary key every
    head shares) and ``q_a_proj`` run whole on each rank, their gradients reduced."""
    plan = derived("deepseek_v3")
    attention = entry(plan, "model.layers.*.self_attn")
    assert attention["params"] == {
        "q_b_proj.weight": {"tp": "S(0)"},
        "kv_b_proj.weight": {"tp": "S(0)"},
        "o_proj.weight": {"tp": "S(1)"},
    }
    assert set(attention["grad_reduce_params"]) == {
        "q_a_proj.weight",
        "q_a_layernorm.weight",
        "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight",
    }
    assert list(attention["in_src"]) == ["hidden_states"]  # not the cache or **kwargs mixed into the latent
    assert "kv_a_proj_with_mqa" in plan["comments"]["sharded"]["model.layers.*.self_attn"]


def test_transformers_mla_plan_is_completed_with_the_attention() -> None:
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model

    plan = plan_model(meta_model(tiny("deepseek_v3")), tp=2, name="deepseek_v3")
    assert plan["comments"]["plan_source"] == "transformers' plan"
    assert entry(plan, "model.layers.*.self_attn")["params"]["kv_b_proj.weight"] == {"tp": "S(0)"}


LATENT_SOURCE = '''
from torch import nn


class LatentAttention(nn.Module):
    def __init__(self, cut):
        super().__init__()
        self.cut = cut
        self.num_heads = 4
        self.head_dim = 16
        self.q_proj = nn.Linear(64, 64, bias=False)
        self.kv_a = nn.Linear(64, 48, bias=False)
        self.kv_norm = nn.LayerNorm(32)
        self.kv_b = nn.Linear(32, 4 * 32, bias=False)
        self.o_proj = nn.Linear(64, 64, bias=False)

    def forward(self, hidden_states):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, -1, 16).transpose(1, 2)
        latent, rot = self.kv_a(hidden_states).split([32, 16], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, s, -1, 32).transpose(1, 2)
        k, v = kv.split([16, 16], dim=-1)
        if self.cut:
            rot = rot.view(b, s, -1, 4).transpose(1, 2)  # the shared value cut into four "heads"
        else:
            rot = rot.view(b, 1, s, 16).expand(-1, k.shape[1], -1, -1)  # one head, shared
        k = k + rot
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    def __init__(self, cut):
        super().__init__()
        self.attn = LatentAttention(cut)

    def forward(self, hidden_states):
        return hidden_states + self.attn(hidden_states)


class Model(nn.Module):
    def __init__(self, cut):
        super().__init__()
        self.layers = nn.ModuleList([Layer(cut) for _ in range(2)])

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states
'''


@pytest.mark.parametrize("cut", [False, True])
def test_a_replicated_latent_is_shared_by_the_heads_or_the_group_stays_replicated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: bool
) -> None:
    """The latent ``kv_a`` stays replicated next to sharded heads only while it enters them as one head
    expanded to all; cut into heads itself, it would need a per-head slice, so the group is refused."""
    import importlib.util

    from hpgen.planner.derive.derivation import derive

    path = tmp_path / "latent_model.py"
    path.write_text(LATENT_SOURCE)
    spec = importlib.util.spec_from_file_location("latent_model", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(__import__("sys").modules, "latent_model", module)  # inspect finds the classes' file
    spec.loader.exec_module(module)
    derivation = derive(module.Model(cut), tp=2, source=path)
    notes = {note.target: note.text for note in derivation.notes if not note.sharded}
    if cut:
        assert "layers.0.attn" not in derivation.placed
        assert "cuts the replicated output of attn.kv_a into heads" in notes["layers.*.attn.o_proj"]
    else:
        block = derivation.placed["layers.0.attn"]
        assert placements(block) == {"q_proj.weight": "S(0)", "kv_b.weight": "S(0)", "o_proj.weight": "S(1)"}
        assert block.grad_reduce == {"kv_a.weight", "kv_norm.weight", "kv_norm.bias"}
