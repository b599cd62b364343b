"""Styles of transformers' plan the source contradicts, corrected (:mod:`hpgen.planner.translate.corrections`)."""

from __future__ import annotations

import pytest

from tests.planner.plan_helpers import entry, translated


def test_a_packed_gate_up_split_by_chunk_is_corrected_to_packed_colwise() -> None:
    # transformers' inkling plan says colwise for experts.gate_up_proj, which forward splits with
    # chunk(2) (inkling2 through self._apply_gate): each rank needs its chunk of both blocks
    for model_type in ("inkling_text", "inkling2_text"):
        _, plan = translated(model_type)
        experts = entry(plan, "model.layers.*.mlp.experts")
        assert experts["params"]["gate_up_proj"] == {"tp": "SS(1,2)"}, model_type
        assert "chunk(2)" in plan["comments"]["corrected"]["model.layers.*.mlp.experts.gate_up_proj"]
    # the shared experts' gating weights, a second input of a sharded MLP-like block, get R -> R too; transformers
    # <= 5.24's plan shards them, 5.25's leaves them out and hpgen reads the same rules from their shapes
    model, inkling = translated("inkling_text")
    shared = entry(inkling, "model.layers.*.mlp.shared_experts")
    assert shared["in_src"] == {"hidden_states": {"tp": "R"}, "gammas": {"tp": "R"}}
    assert shared["params"] == {"gate_proj": {"tp": "S(1)"}, "up_proj": {"tp": "S(1)"}, "down_proj": {"tp": "S(2)"}}
    assert shared["out_src"] == {"output": {"tp": "P(sum)"}}
    # the note names whose colwise it corrects: transformers' where its plan has the experts, hpgen's otherwise
    ours = "hpgen's experts rule (read from the weights' shapes: this release's plan leaves the experts out) says colwise"
    for model, plan in ((model, inkling), translated("qwen3_moe")):
        note = plan["comments"].get("corrected", {}).get("model.layers.*.mlp.experts.gate_up_proj")
        if "model.layers.*.mlp.experts" not in (model.tp_plan or {}):  # 5.25: hpgen's colwise, corrected
            assert note.startswith(ours) and "chunk(2)" in note, note
        elif model.tp_plan["model.layers.*.mlp.experts.gate_up_proj"] == "colwise":  # inkling on 5.24
            assert note.startswith("transformers' plan says colwise") and "chunk(2)" in note, note
        else:  # qwen3_moe on 5.24: transformers' plan says packed_colwise already
            assert note is None
    qwen3_moe = plan
    assert entry(qwen3_moe, "model.layers.*.mlp.experts")["params"]["gate_up_proj"] == {"tp": "SS(1,2)"}


def _with_plan(model_type: str, tp_plan: dict[str, str]) -> dict:
    """transformers' tiny ``model_type`` planned at tp 2 with ``tp_plan`` in place of its own, as a config may."""
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import meta_model
    from hpgen.verify.shrink import tiny_config

    config = tiny_config(model_type)
    config.base_model_tp_plan = tp_plan
    return plan_model(meta_model(config), tp=2, name=model_type)


def test_the_split_is_followed_through_a_variable() -> None:
    # Phi3MLP: up_states = self.gate_up_proj(x); gate, up_states = up_states.chunk(2, dim=-1)
    plan = _with_plan("phi3", {"layers.*.mlp.gate_up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"})
    assert entry(plan, "model.layers.*.mlp")["params"]["gate_up_proj.weight"] == {"tp": "SS(0,2)"}
    assert "Phi3MLP.forward splits the output of gate_up_proj with chunk(2)" in (
        plan["comments"]["corrected"]["model.layers.*.mlp.gate_up_proj"]
    )


def test_a_colwise_split_into_unequal_blocks_is_refused() -> None:
    from hpgen.core.errors import HpgenError

    # multi-query GPTBigCode: c_attn's output split into [queries | key | value] of unequal sizes
    refusal = r"c_attn: transformers' plan says colwise, but .* unequal sizes \[64, 16, 16\]"
    with pytest.raises(HpgenError, match=refusal):
        _with_plan("gpt_bigcode", {"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise"})


def test_a_colwise_split_into_other_than_two_blocks_is_refused(tmp_path, monkeypatch) -> None:
    # packed_colwise says two blocks; a colwise whose output forward cuts in three has no style to become
    import textwrap

    from hpgen.core.errors import HpgenError
    from hpgen.planner.translate.corrections import correct_packed_chunks
    from hpgen.planner.translate.forwards import Forwards
    from hpgen.planner.translate.styles import Rule, StyleRules
    from tests.support.modules import import_file

    path = tmp_path / "modeling_three.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch.nn as nn


            class Block(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.gate_up = nn.Linear(4, 8)
                    self.qkv = nn.Linear(4, 12)
                    self.out = nn.Linear(4, 4)

                def forward(self, x):
                    gate, up = self.gate_up(x).chunk(2, dim=-1)
                    q, k, v = self.qkv(x).chunk(3, dim=-1)
                    return self.out(gate * up + q * k * v)


            class Model(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.block = Block()

                def forward(self, x):
                    return self.block(x)
            """
        )
    )
    model = import_file(path, monkeypatch).Model()
    modules, forwards = dict(model.named_modules()), Forwards(type(model), "three")

    def rules(name: str) -> StyleRules:
        return StyleRules(
            {name: Rule("colwise", "tp"), f"{name}.weight": Rule("colwise", "tp", True)}, ("tp",), {"tp": 2}
        )

    corrected, why = correct_packed_chunks(rules("block.gate_up"), modules, forwards)
    assert {name: rule.style for name, rule in corrected.rules.items()} == {
        "block.gate_up": "packed_colwise",
        "block.gate_up.weight": "packed_colwise",
    }
    assert "Block.forward splits the output of gate_up with chunk(2)" in why["block.gate_up"]
    with pytest.raises(HpgenError, match=r"block.qkv: .* into 3 packed blocks with chunk\(3\).* --from-source"):
        correct_packed_chunks(rules("block.qkv"), modules, forwards)


def test_transposed_experts_are_not_read_crosswise() -> None:
    # Aria's experts hold [n, in, out] weights (is_transposed): gate_up_proj [n, hidden, 2 x intermediate] read by
    # shape alone looked row-parallel and down_proj column-parallel, and the plan lost parity on 5.25 (logits off
    # by 6.6). transformers <= 5.24's plan shards them itself (packed_rowwise / colwise); where a release's plan
    # leaves them out, hpgen keeps them whole rather than guess the packed halves
    from hpgen.planner.model.load import meta_model
    from hpgen.planner.translate.expert_tp import model_tp_plan
    from hpgen.verify.shrink import tiny_config

    model = meta_model(tiny_config("aria_text"))
    plan = model_tp_plan(model)
    if "model.layers.*.mlp.experts" in (model.tp_plan or {}):
        assert plan["model.layers.*.mlp.experts.gate_up_proj"] == "packed_rowwise"
    else:
        assert not any(key.startswith("model.layers.*.mlp.experts") for key in plan), plan
