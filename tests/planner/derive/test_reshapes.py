"""Packed blocks read from the dataflow (:func:`hpgen.planner.derive.reshapes.packed_blocks`), the one reading that
both the derived plans and the translator's correction of transformers' ``colwise`` use."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.support.modules import import_file

SOURCE = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = nn.Parameter(torch.zeros(2, 8, 4))  # [experts, 2 * intermediate, hidden]
            self.fused = nn.Parameter(torch.zeros(2, 8, 4))
            self.plain = nn.Parameter(torch.zeros(2, 8, 4))
            self.qkv = nn.Linear(4, 12)
            self.mlp_in = nn.Linear(4, 8)
            self.act = nn.SiLU()

        def forward(self, x, e):
            y = self._gate(F.linear(x, self.gate_up[e]))  # chunked in a method the forward calls
            a, b = F.linear(x, self.fused[e]).chunk(2, dim=-1)
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            g, u = self.act(self.mlp_in(x)).view(*x.shape[:-1], 2, -1).unbind(-2)  # gate and up, or two heads?
            return y + a * b + F.linear(x, self.plain[e]) + q + k + v + g * u

        def _gate(self, h):
            gate, up = h.chunk(2, dim=-1)
            return gate * up
    """
)


def _experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str = SOURCE) -> tuple[object, Path]:
    path = tmp_path / f"modeling_packed_{len(list(tmp_path.iterdir()))}.py"
    path.write_text(source)
    return import_file(path, monkeypatch).Experts(), path


def test_packed_blocks_follow_weights_applied_directly_layers_and_the_methods_called(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpgen.planner.derive.reshapes import packed_blocks
    from hpgen.planner.flow import run_module

    model, path = _experts(tmp_path, monkeypatch)
    flow = run_module(model, "", path)
    found = packed_blocks(flow, "", {"gate_up": 8, "fused": 8, "plain": 8, "qkv": 12, "mlp_in": 8})
    # a view's [2, -1] is gate and up in an MLP but two key/value heads in an attention: without head counts it
    # says nothing (a derived group, which knows them, reads it)
    assert {name: blocks.count for name, blocks in found.items()} == {"gate_up": 2, "fused": 2, "qkv": 3}
    assert found["gate_up"].says() == "chunk(2)"


def test_unequal_blocks_are_not_read_as_packed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpgen.planner.derive.column_layouts import UnequalBlocks
    from hpgen.planner.derive.reshapes import packed_blocks
    from hpgen.planner.flow import run_module

    source = SOURCE.replace("self.qkv(x).chunk(3, dim=-1)", "self.qkv(x).split([8, 2, 2], dim=-1)")
    model, path = _experts(tmp_path, monkeypatch, source)
    with pytest.raises(UnequalBlocks, match="unequal sizes"):
        packed_blocks(run_module(model, "", path), "", {"qkv": 12})
