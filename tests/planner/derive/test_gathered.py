"""Columns that read another column's output whole, gathered on entry (:mod:`hpgen.planner.derive.gathered`)."""

from __future__ import annotations

import pytest

from tests.support.derived_configs import tiny
from tests.planner.plan_helpers import entry, placements, plan_model_of


def test_a_projection_reading_the_values_whole_is_gathered_on_entry() -> None:
    # Doge's dt_proj reads every value head (kv_heads * head_dim -> kv_heads) to build one mask row per
    # key/value head: column-parallel over its outputs, its input gathered (S(-1) -> R), its output
    # sharded with the heads; A (one per key/value head) follows. transformers' rowwise dt_proj is
    # replaced by the derived attention; the MLP stays as transformers' plan has it.
    from hpgen.planner.derive.derivation import derive
    from hpgen.planner.model.load import meta_model

    derivation = derive(meta_model(tiny("doge")), tp=2)
    assert derivation.placed["model.layers.0.self_attn"].kind == "block"
    leaf = derivation.placed["model.layers.0.self_attn.dt_proj"]
    assert leaf.kind == "gather_leaf" and placements(leaf) == {"weight": "S(0)", "bias": "S(0)"}
    attn = placements(derivation.placed["model.layers.0.self_attn"])
    assert attn["A"] == "S(0)" and not any(name.startswith("dt_proj.") for name in attn)
    plan = plan_model_of("doge")
    assert plan["comments"]["plan_source"] == "transformers' plan"
    dt_proj = entry(plan, "model.layers.*.self_attn.dt_proj")
    assert dt_proj["in_src"] == {"input": {"tp": "S(-1)"}} and dt_proj["in_dst"] == {"input": {"tp": "R"}}
    assert dt_proj["out_src"] == dt_proj["out_dst"] == {"output": {"tp": "S(-1)"}}
    assert entry(plan, "model.layers.*.self_attn")["params"]["o_proj.weight"] == {"tp": "S(1)"}
    assert "gathers its input" in plan["comments"]["replaced"]["model.layers.*.self_attn"]
    assert "model.layers.*.mlp" in plan["param_plan"]
    # --sp: the derived attention is entered from the sequence-sharded stream like transformers' MLP
    from hpgen.planner.entry.make import plan_model

    sp = plan_model(meta_model(tiny("doge")), tp=2, sp=True, name="doge")
    assert entry(sp, "model.layers.*.self_attn")["in_src"] == {"hidden_states": {"tp": "S(1)"}}
    assert entry(sp, "model.layers.*.self_attn.dt_proj")["in_src"] == {"input": {"tp": "S(-1)"}}
    assert entry(sp, "model.layers.*.mlp")["in_src"] == {"x": {"tp": "S(1)"}}


def test_a_gathered_column_must_write_one_value_per_head_of_a_plain_layout() -> None:
    import torch.nn as nn

    from hpgen.planner.derive.column_layouts import PLAIN, grouped, packed
    from hpgen.planner.derive.gathered import check_gathered
    from hpgen.planner.derive.heads.counts import Heads
    from hpgen.planner.derive.placed import Contradicted

    modules = {"a.v": nn.Linear(64, 32), "a.dt": nn.Linear(32, 2), "a.mix": nn.Linear(32, 3)}
    heads = Heads(query=4, kv=2, head_dim=16)
    check_gathered({"a.dt": {"a.v"}}, modules, {"a.v": PLAIN}, heads, 2, "a")  # one per key/value head
    with pytest.raises(Contradicted, match="not one per head"):
        check_gathered({"a.mix": {"a.v"}}, modules, {"a.v": PLAIN}, heads, 2, "a")
    for layout in (packed(2), grouped(2)):  # blocks, or heads interleaved with their values: out of order gathered
        with pytest.raises(Contradicted, match="packed layout"):
            check_gathered({"a.dt": {"a.v"}}, modules, {"a.v": layout}, heads, 2, "a")
    with pytest.raises(Contradicted, match="do not divide"):
        check_gathered({"a.dt": {"a.v"}}, modules, {"a.v": PLAIN}, heads, 4, "a")
