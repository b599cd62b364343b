"""The per-channel state leaves a mixer reads, a recurrence opened (:mod:`hpgen.planner.derive.channels.state_leaves`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.planner.plan_helpers import derived, entry, placements


def test_a_recurrent_block_shards_its_channels_through_the_recurrence_it_holds() -> None:
    """RecurrentGemma: the RG-LRU holds the per-channel state (a leaf of the file, opened and read), so
    linear_x/linear_y are columns, linear_out the row, the depthwise conv (called as a module: its groups
    divided) and the RG-LRU's per-head gates follow the channels; the sliding attention still shards."""
    plan = derived("recurrent_gemma")
    for layer in (0, 1):
        block = entry(plan, f"model.layers.{layer}.temporal_block")
        params = {name: layout["tp"] for name, layout in block["params"].items()}
        assert params == {
            "linear_x.weight": "S(0)", "linear_x.bias": "S(0)", "linear_y.weight": "S(0)", "linear_y.bias": "S(0)",
            "linear_out.weight": "S(1)", "linear_out.bias": "R",
            "conv_1d.weight": "S(0)", "conv_1d.bias": "S(0)", "rg_lru.recurrent_param": "S(0)",
            "rg_lru.input_gate_weight": "S(0)", "rg_lru.input_gate_bias": "S(0)",
            "rg_lru.recurrent_gate_weight": "S(0)", "rg_lru.recurrent_gate_bias": "S(0)",
        }  # fmt: skip
        assert block["deferred_bias_params"] == ["linear_out.bias"]
        # the states it allocates for the cache: torch.zeros((batch, self.lru_width)), (batch, self.hidden_size, ..)
        assert block["tp_divide_attrs"] == ["hidden_size", "lru_width"]
    assert entry(plan, "model.layers.*.temporal_block.rg_lru")["tp_divide_attrs"] == ["num_attention_heads"]
    conv = entry(plan, "model.layers.*.temporal_block.conv_1d")
    assert conv["tp_divide_attrs"] == ["groups", "in_channels", "out_channels"]
    attention = entry(plan, "model.layers.2.temporal_block")
    assert attention["params"]["q_proj.weight"] == {"tp": "S(0)"} and attention["params"]["o_proj.weight"] == {
        "tp": "S(1)"
    }
    assert plan["comments"]["replicated"] == {}


RECURRENT_SOURCE = '''
import types

import torch
from torch import nn


class Recurrence(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = 4
        self.width = 16
        self.gate = nn.Parameter(torch.zeros(4, 16, 16))
        self.decay = nn.Parameter(torch.zeros(64))

    def forward(self, x):
        b, s, c = x.shape
        h = self._heads(x, b * s)
        g = torch.sigmoid(torch.bmm(h, self.gate).transpose(0, 1).reshape(b, s, c))
        return self._scan(x * self._mixed(g), torch.exp(self.decay))

    def _heads(self, x, n):
        return x.reshape(n, self.heads, self.width).permute(1, 0, 2)

    def _mixed(self, g):
        return g

    def _scan(self, x, a):
        state = torch.zeros(x[:, 0].shape)
        out = torch.zeros_like(x)
        for t in range(x.shape[1]):
            state = a * state + x[:, t]
            out[:, t] = state
        return out


class MinorRecurrence(Recurrence):
    def _heads(self, x, n):  # heads interleaved: channel i belongs to head i % heads
        return x.reshape(n, self.width, self.heads).transpose(1, 2).permute(1, 0, 2)


class MeanRecurrence(Recurrence):
    def _mixed(self, g):
        return g - g.mean(-1, keepdim=True)


class DenseRecurrence(Recurrence):
    def __init__(self):
        super().__init__()
        self.mix = nn.Parameter(torch.zeros(64, 64))

    def _mixed(self, g):
        return g @ self.mix


RECURRENCES = {"plain": Recurrence, "minor": MinorRecurrence, "mean": MeanRecurrence, "dense": DenseRecurrence}


class Block(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.channels = 64
        self.linear_x = nn.Linear(64, 64)
        self.linear_y = nn.Linear(64, 64)
        self.linear_out = nn.Linear(64, 64)
        self.conv = nn.Conv1d(64, 64, 4, groups=64, padding=3)
        self.rec = RECURRENCES[variant]()

    def forward(self, hidden_states):
        y = nn.functional.gelu(self.linear_y(hidden_states))
        x = self.linear_x(hidden_states).transpose(1, 2)
        x = self.conv(x)[..., : hidden_states.shape[1]].transpose(1, 2)
        start = torch.zeros((hidden_states.shape[0], 1, self.channels))
        return self.linear_out((self.rec(x) + start) * y)


class Layer(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.mixer = Block(variant)

    def forward(self, hidden_states):
        return hidden_states + self.mixer(self.norm(hidden_states))


class Model(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=64)
        self.layers = nn.ModuleList([Layer(variant) for _ in range(2)])

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states
'''


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ("plain", None),
        ("minor", "does not reshape its 64 channels head-major into (4, 16)"),
        ("mean", "calls mean at line"),
        ("dense", "not a state-space mixer"),
    ],
)
def test_a_recurrence_is_opened_and_shards_only_where_its_code_works_per_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str, reason: str | None
) -> None:
    """A leaf of the file holding per-head gates and per-channel decays: sharded with the channels when it cuts
    the heads head-major and combines nothing across channels; heads cut channel-minor or a mean over the
    channels make the honest gather around a replicated body; a ``[C, C]`` matrix is no per-channel state."""
    import importlib.util

    from hpgen.planner.derive.derivation import derive

    path = tmp_path / "recurrent_model.py"
    path.write_text(RECURRENT_SOURCE)
    spec = importlib.util.spec_from_file_location("recurrent_model", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(__import__("sys").modules, "recurrent_model", module)  # inspect finds the classes' file
    spec.loader.exec_module(module)
    derivation = derive(module.Model(variant), tp=2, source=path)
    placed = derivation.placed
    notes = {note.target: note.text for note in derivation.notes}
    if reason is None:
        block = placed["layers.0.mixer"]
        assert block.kind == "block" and placements(block)["linear_out.weight"] == "S(1)"
        assert {placements(block)[n] for n in ("rec.gate", "rec.decay", "conv.weight", "linear_x.weight")} == {"S(0)"}
        assert block.divide == {"channels"}  # the state it allocates
        assert placed["layers.0.mixer.rec"].divide == {"heads"}  # the reshape into heads; `width` stays
        assert placed["layers.0.mixer.conv"].divide == {"groups", "in_channels", "out_channels"}
    elif variant == "dense":
        assert "layers.0.mixer" not in placed and "layers.0.mixer.linear_x" not in placed
        assert "not part of a column -> row pair" in notes["layers.*.mixer.linear_out"]
    else:
        assert "layers.0.mixer" not in placed  # the body runs replicated between gathered and split projections
        assert placed["layers.0.mixer.linear_x"].kind == "col_gather"
        assert placed["layers.0.mixer.linear_out"].kind == "split_row"
        assert reason in notes["layers.*.mixer.linear_x"]
