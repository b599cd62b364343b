"""Channel-parallel state-space mixers (:mod:`hpgen.planner.derive.channels.state_space`)."""

from __future__ import annotations

from tests.planner.plan_helpers import derived, entry


def test_mamba_mixer_shards_its_channels_and_reduces_x_proj() -> None:
    plan = derived("mamba")
    mixer = entry(plan, "backbone.layers.*.mixer")
    assert mixer["params"] == {
        "in_proj.weight": {"tp": "SS(0,2)"},  # chunk(2): the [x | z] blocks, each rank its chunk of both
        "conv1d.weight": {"tp": "S(0)"},  # depthwise: one filter per channel
        "conv1d.bias": {"tp": "S(0)"},
        "A_log": {"tp": "S(0)"},
        "D": {"tp": "S(0)"},
        "dt_proj.weight": {"tp": "S(0)"},
        "dt_proj.bias": {"tp": "S(0)"},
        "out_proj.weight": {"tp": "S(1)"},
    }
    assert mixer["in_dst"] == {"hidden_states": {"tp": "R"}} and mixer["out_src"] == {"output": {"tp": "P(sum)"}}
    x_proj = entry(plan, "backbone.layers.*.mixer.x_proj")
    assert x_proj["params"] == {"weight": {"tp": "S(1)"}}
    assert x_proj["in_src"] == {"input": {"tp": "S(-1)"}} and x_proj["out_dst"] == {"output": {"tp": "R"}}
    assert x_proj["out_grad_partial"] == ["output"]  # dt, B, C feed the sharded scan: reduced in backward too
    assert plan["comments"]["replicated"] == {}


def test_zamba_mixer_shards_whole_mamba_heads() -> None:
    plan = derived("zamba")
    mixer = entry(plan, "model.layers.*.mamba_decoder.mamba")
    # view(batch, -1, 2, seq): each channel's x and gate side by side, so a plain shard keeps the pairs
    assert mixer["params"]["in_proj.weight"] == {"tp": "S(0)"}
    for name in ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D"):  # [heads, ...]
        assert mixer["params"][name] == {"tp": "S(0)"}
    assert mixer["tp_divide_attrs"] == ["n_mamba_heads"]
    assert not any(key.endswith("x_proj") for key in plan["param_plan"])  # per head: nothing to reduce


def test_mixers_the_placements_cannot_cut_gather_around_a_replicated_scan() -> None:
    plan = derived("mamba2")  # in_proj packs z|x|B|C|dt, blocks of unequal sizes
    in_proj = entry(plan, "backbone.layers.*.mixer.in_proj")
    assert in_proj["params"] == {"weight": {"tp": "S(0)"}}
    assert in_proj["out_src"] == {"output": {"tp": "S(-1)"}} and in_proj["out_dst"] == {"output": {"tp": "R"}}
    out_proj = entry(plan, "backbone.layers.*.mixer.out_proj")
    assert out_proj["in_src"] == {"input": {"tp": "R"}} and out_proj["in_dst"] == {"input": {"tp": "S(-1)"}}
    assert out_proj["params"] == {"weight": {"tp": "S(1)"}}
    assert "backbone.layers.*.mixer" not in plan["param_plan"]  # the scan runs replicated, unchanged
    assert "unequal sizes" in plan["comments"]["sharded"]["backbone.layers.*.mixer.in_proj"]
    # Zamba's two Mamba heads over 4 ranks: the same honest gather, and the note says why
    four = derived("zamba", tp=4)
    note = four["comments"]["sharded"]["model.layers.*.mamba_decoder.mamba.in_proj"]
    assert "holds 2 heads" in note and "--tp 4" in note
    assert "model.layers.*.mamba_decoder.mamba" not in four["param_plan"]
