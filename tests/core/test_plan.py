"""Plan loading and validation (docs/plan-format.md): data in, typed entries out, errors with JSON paths."""

import json

import pytest

from hpgen.core.errors import HpgenError
from hpgen.core.placement import Placement
from hpgen.core.plan import contract_signature, fqn_matches, load_plan, parse_plan, patterns_overlap, plan_from_dict

from tests.conftest import FIXTURES


def minimal(**entry):
    return {"mesh_dim_names": ["tp"], "param_plan": {"model.layers.*.mlp": entry}}


def error_of(document) -> str:
    with pytest.raises(HpgenError) as caught:
        plan_from_dict(document, name="p.json")
    return str(caught.value)


def test_fixture_plans_load():
    plan = load_plan(FIXTURES / "plan_tp_sp.json")
    assert plan.mesh_dim_names == ("tp",)
    entry = plan.entries["model.layers.*.self_attn"]
    assert entry.out_names == ("attn_output", "attn_weights")
    assert entry.in_src["hidden_states"].on("tp") == Placement("S", dim=1)
    assert entry.params["o_proj.weight"].on("tp") == Placement("S", dim=1)
    assert plan.entries["model.layers.0"].grad_reduce_params == ("input_layernorm.weight", "post_attention_layernorm.weight")
    assert len(plan.sha256) == 64


def test_replicated_shards_and_divisors_of_an_entry():
    plan = plan_from_dict(
        minimal(params={"k_proj.weight": {"tp": "RS(0,2)"}}, divide_attrs={"num_key_value_groups": 2, "a": 3})
    )
    entry = plan.entries["model.layers.*.mlp"]
    assert str(entry.params["k_proj.weight"].on("tp")) == "RS(0,2)"
    assert entry.divide_attrs == (("a", 3), ("num_key_value_groups", 2))  # sorted: key order does not matter


def test_missing_axis_means_replicated():
    plan = plan_from_dict(
        {"mesh_dim_names": ["tp", "sp"], "param_plan": {"a": {"in_src": {"x": {"sp": "S(1)"}}}}}
    )
    layout = plan.entries["a"].in_src["x"]
    assert str(layout.on("tp")) == "R" and str(layout.on("sp")) == "S(1)"
    # A name declared on one side only is replicated on the other.
    src, dst = plan.entries["a"].input_layouts("x", plan.mesh_dim_names)
    assert str(dst.on("sp")) == "R"


def test_is_boundary_defaults_to_having_inputs_or_outputs():
    plan = plan_from_dict(
        {"mesh_dim_names": ["tp"], "param_plan": {"a": {"params": {"w": {"tp": "S(0)"}}}, "b": {"out_src": {"o": {"tp": "P(sum)"}}}}}
    )
    assert not plan.entries["a"].is_boundary
    assert plan.entries["b"].is_boundary


def test_unknown_top_level_keys_are_ignored_for_compatibility():
    plan = plan_from_dict({**minimal(), "codegen_version": 3, "notes": {"x": 1}})
    assert list(plan.entries) == ["model.layers.*.mlp"]


def test_wildcards_match_one_segment():
    assert fqn_matches("model.layers.*.mlp", "model.layers.3.mlp")
    assert not fqn_matches("model.layers.*.mlp", "model.layers.3.mlp.up_proj")
    assert not fqn_matches("model.*.mlp", "model.layers.3.mlp")
    assert patterns_overlap("model.layers.*.mlp", "model.layers.0.mlp")
    assert not patterns_overlap("model.layers.0", "model.layers.*.mlp")


def test_entry_for_and_boundary_classes():
    plan = plan_from_dict(
        {
            "mesh_dim_names": ["tp"],
            "boundary_classes": {"model.layers.*.mlp": "LlamaMLP"},
            "param_plan": {"model.layers.*.mlp": {"out_src": {"o": {"tp": "P(sum)"}}}},
        }
    )
    assert plan.entry_for("model.layers.7.mlp").key == "model.layers.*.mlp"
    assert plan.entry_for("model.layers.7.self_attn") is None
    assert plan.boundary_class_for("model.layers.*.mlp") == "LlamaMLP"


def test_injection_targets_and_kwargs():
    plan = plan_from_dict(
        {
            **minimal(out_src={"o": {"tp": "P(sum)"}}),
            "injections": [{"match": "model.layers.*.mlp", "local_compute_fn": {"_target_": "pkg.mod.fn", "k": [1, 2]}}],
        }
    )
    injection = plan.injection_for("model.layers.*.mlp")
    assert injection.local_compute_fn.path == "pkg.mod.fn"
    assert injection.local_compute_fn.kwargs_dict() == {"k": [1, 2]}


def test_key_order_does_not_change_the_plan_or_the_signature():
    entry = {
        "in_src": {"x": {"tp": "S(1)"}, "y": {"tp": "R"}},
        "out_src": {"o": {"tp": "P(sum)"}},
        "params": {"b.weight": {"tp": "S(0)"}, "a.weight": {"tp": "S(1)"}},
    }
    reordered = {key: dict(reversed(list(value.items()))) for key, value in reversed(list(entry.items()))}
    first = plan_from_dict(minimal(**entry))
    second = plan_from_dict(minimal(**reordered))
    assert first.entries == second.entries
    key = "model.layers.*.mlp"
    assert contract_signature(first, key) == contract_signature(second, key)


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ([], "expected a JSON object, got a list"),
        ({"param_plan": {}}, "missing required key 'mesh_dim_names'"),
        ({"mesh_dim_names": ["tp"]}, "missing required key 'param_plan'"),
        ({"mesh_dim_names": [], "param_plan": {}}, "mesh_dim_names: needs at least one axis"),
        ({"mesh_dim_names": ["t p"], "param_plan": {}}, "mesh_dim_names[0]: 't p' is not an axis name"),
        ({"mesh_dim_names": ["tp", "tp"], "param_plan": {}}, "mesh_dim_names[1]: 'tp' is listed twice"),
        ({"mesh_dim_names": ["class"], "param_plan": {}}, "'class' is not an axis name"),
        ({**minimal(), "format": "hpgen.plan/9"}, "format: unsupported plan format 'hpgen.plan/9'"),
        (
            minimal(out_src={"output": {"tp": "S(x)"}}),
            """param_plan["model.layers.*.mlp"].out_src.output.tp: 'S(x)' is not a placement""",
        ),
        (
            minimal(in_src={"x": {"cp": "R"}}),
            """param_plan["model.layers.*.mlp"].in_src.x.cp: unknown axis 'cp' (mesh_dim_names: tp)""",
        ),
        (minimal(in_srcs={}), """param_plan["model.layers.*.mlp"].in_srcs: unknown key 'in_srcs'"""),
        (minimal(in_src={"x y": {"tp": "R"}}), """in_src["x y"]: 'x y' is not a parameter or output name"""),
        (minimal(in_src={"x": "R"}), """in_src.x: expected a JSON object, got the string 'R'"""),
        (
            minimal(out_src={"a": {"tp": "P(sum)"}}, out_dst={"b": {"tp": "R"}}),
            "several outputs (a, b) need 'out_names'",
        ),
        (minimal(out_names=["a"], out_src={"b": {"tp": "P(sum)"}}), "out_src.b: 'b' is not in out_names (a)"),
        (minimal(params={"q proj.weight": {"tp": "S(0)"}}), "'q proj.weight' is not a parameter path"),
        (minimal(is_boundary="yes"), "is_boundary: expected true or false, got the string 'yes'"),
        (minimal(tp_divide_attrs=["num heads"]), "tp_divide_attrs[0]: 'num heads' is not an identifier"),
        (
            minimal(out_src={"output": {"tp": "RS(0,2)"}}),
            "out_src.output.tp: RS(0,2) is a parameter placement (params); inputs and outputs take R, S(d), P or SS",
        ),
        (minimal(divide_attrs={"num_key_value_groups": 0}), "divide_attrs.num_key_value_groups: expected a positive"),
        (minimal(divide_attrs={"num_key_value_groups": True}), "expected a positive integer divisor, got a boolean"),
        (minimal(divide_attrs={"a b": 2}), "'a b' is not an attribute name"),
        (
            minimal(out_src={"output": {"tp": "P(sum)"}}, out_grad_partial=["outputs"]),
            "out_grad_partial: 'outputs' is not a declared output (output)",
        ),
        (
            minimal(tp_divide_attrs=["num_heads"], divide_attrs={"num_heads": 2}),
            "divide_attrs.num_heads: 'num_heads' is in tp_divide_attrs too",
        ),
        ({"mesh_dim_names": ["tp"], "param_plan": {"model.layers..mlp": {}}}, "is not a module FQN"),
        (
            {"mesh_dim_names": ["tp"], "param_plan": {"model.layers.*.mlp": {}, "model.layers.0.mlp": {}}},
            "matches the same modules as 'model.layers.*.mlp'",
        ),
        ({**minimal(), "model_class": "import os"}, "model_class: 'import os' is not a class name"),
        ({**minimal(), "boundary_classes": {"model.x": "os.system('x')"}}, "is not a class name or dotted path"),
        (
            {**minimal(), "injections": [{"match": "model.other", "local_compute_fn": "a.b"}]},
            "injections[0].match: 'model.other' matches no param_plan key",
        ),
        (
            {**minimal(), "injections": [{"match": "model.layers.*.mlp", "local_compute_fn": "__import__('os')"}]},
            "injections[0].local_compute_fn: \"__import__('os')\" is not a dotted path",
        ),
        (
            {**minimal(), "injections": [{"match": "model.layers.*.mlp", "local_compute_fn": {"k": 1}}]},
            "needs '_target_'",
        ),
    ],
)
def test_bad_plans_name_the_place(document, expected):
    message = error_of(document)
    assert message.startswith("p.json")
    assert expected in message


def test_invalid_json_names_line_and_column():
    with pytest.raises(HpgenError) as caught:
        parse_plan(b'{"mesh_dim_names": ["tp"],\n  "param_plan": {,}}', name="bad.json")
    assert str(caught.value).startswith("bad.json:2:")
    assert "invalid JSON" in str(caught.value)


def test_duplicate_json_keys_are_an_error():
    with pytest.raises(HpgenError, match="duplicate key 'param_plan'"):
        parse_plan(json.dumps({"mesh_dim_names": ["tp"]})[:-1] + ', "param_plan": {}, "param_plan": {}}')


def test_unreadable_plan(tmp_path):
    with pytest.raises(HpgenError, match="cannot read plan"):
        load_plan(tmp_path / "missing.json")


# --------------------------------------------------------------------------- hpgen.plan/2: whole units, blocks, local_attrs

FALCON_ATTENTION = {
    "params": {
        "query_key_value.weight": {"tp": "B(0, 4544:S(0,64), 64:R, 64:R)"},
        "dense.weight": {"tp": "S(1,64)"},
    },
    "local_attrs": {"num_heads": {"of": "query_key_value.weight", "dim": 0, "block": 0, "unit": 64}},
}


def test_whole_units_blocks_and_local_attrs_load():
    plan = plan_from_dict({"format": "hpgen.plan/2", **minimal(**FALCON_ATTENTION)})
    entry = plan.entries["model.layers.*.mlp"]
    assert str(entry.params["query_key_value.weight"].on("tp")) == "B(0,4544:S(0,64),64:R,64:R)"
    ((name, count),) = entry.local_attrs
    assert name == "num_heads" and (count.of, count.dim, count.block, count.unit, count.per) == (
        "query_key_value.weight", 0, 0, 64, None
    )
    assert count.document() == {"of": "query_key_value.weight", "dim": 0, "unit": 64, "block": 0}
    assert plan.required_format() == "hpgen.plan/2"
    # A document without "format" takes them too; a plan without them needs only hpgen.plan/1.
    assert plan_from_dict(minimal(**FALCON_ATTENTION)).required_format() == "hpgen.plan/2"
    assert plan_from_dict(minimal(params={"w": {"tp": "S(0,1)"}})).required_format() == "hpgen.plan/1"


def test_local_count_values_per_rank():
    """Qwen2.5-7B at tp 8: 4 or 3 query heads per rank, all of one key/value head's group."""
    from hpgen.core.plan import LocalCount as LocalCountOf
    from hpgen.core.shards import ShardLayout

    plan = plan_from_dict(
        minimal(
            params={"q_proj.weight": {"tp": "S(0,128,4)"}, "k_proj.weight": {"tp": "RS(0,2)"}},
            local_attrs={
                "num_heads": {"of": "q_proj.weight", "dim": 0, "unit": 128},
                "num_key_value_groups": {"of": "q_proj.weight", "dim": 0, "per": {"of": "k_proj.weight", "dim": 0}},
            },
        )
    )
    entry = plan.entries["model.layers.*.mlp"]
    shapes = {"q_proj.weight": (28 * 128, 3584), "k_proj.weight": (4 * 128, 3584)}
    counts = dict(entry.local_attrs)
    for rank in range(8):
        def shard_of(name):
            return ShardLayout(shapes[name], [(entry.params[name].on("tp"), rank, 8)])

        assert counts["num_heads"].value(shard_of) == (4 if rank % 2 == 0 else 3)
        assert counts["num_key_value_groups"].value(shard_of) == (4 if rank % 2 == 0 else 3)
    # whole groups of [16 query | key | value] heads (18 units of 8) cut over 3 ranks: 3, 3, 2 groups
    groups = LocalCountOf("qkv", 0, unit=18 * 8, times=16)
    fused = [groups.value(lambda name, r=rank: ShardLayout((8 * 18 * 8, 4), [(Placement.parse("S(0,144)"), r, 3)])) for rank in range(3)]
    assert fused == [48, 48, 32]
    assert groups.document() == {"of": "qkv", "dim": 0, "unit": 144, "times": 16}
    with pytest.raises(ValueError, match="not laid out in blocks"):
        from hpgen.core.plan import LocalCount

        LocalCount("q_proj.weight", 0, block=0).value(lambda name: ShardLayout(shapes[name], []))


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (
            {"format": "hpgen.plan/1", **minimal(params={"w": {"tp": "S(0,64)"}})},
            "params.w.tp: S(0,64) (a placement in whole units or blocks) is new in 'hpgen.plan/2', but the plan says",
        ),
        (
            {"format": "hpgen.plan/1", **minimal(local_attrs={"n": {"of": "w", "dim": 0}})},
            "local_attrs: local_attrs is new in 'hpgen.plan/2'",
        ),
        ({"format": "hpgen.plan/3", **minimal()}, "unsupported plan format 'hpgen.plan/3' (expected 'hpgen.plan/1' or 'hpgen.plan/2')"),
        (minimal(in_src={"x": {"tp": "S(0,64)"}}), "in_src.x.tp: S(0,64) is a parameter placement (params)"),
        (minimal(out_dst={"y": {"tp": "B(0,8:R,8:S(0))"}}), "is a parameter placement (params)"),
        (minimal(local_attrs={"n": {"of": "w"}}), "local_attrs.n: missing required key 'dim'"),
        (minimal(local_attrs={"n": {"of": "w", "dim": 0, "unit": 0}}), "local_attrs.n.unit: expected an integer of at least 1"),
        (minimal(local_attrs={"n": {"of": "w", "dim": "0"}}), "local_attrs.n.dim: expected an integer, got the string '0'"),
        (minimal(local_attrs={"n": {"of": "w", "dim": 0, "times": 0}}), "local_attrs.n.times: expected an integer of at least 1"),
        (minimal(local_attrs={"n": {"of": "w w", "dim": 0}}), "'w w' is not a parameter path"),
        (minimal(local_attrs={"n": {"of": "w", "dim": 0, "heads": 2}}), "unknown key 'heads' in a local_attrs count"),
        (
            minimal(local_attrs={"n": {"of": "w", "dim": 0, "per": {"of": "v", "dim": 0, "per": {"of": "w", "dim": 0}}}}),
            "unknown key 'per' in a local_attrs count",
        ),
        (minimal(tp_divide_attrs=["n"], local_attrs={"n": {"of": "w", "dim": 0}}), "local_attrs.n: 'n' is in tp_divide_attrs too"),
    ],
)
def test_plan_2_refusals(document, message):
    assert message in error_of(document)


def test_grad_reduce_params_may_name_the_axes_of_each_sum():
    two = {"mesh_dim_names": ["dp", "tp"], "param_plan": {"m": {"grad_reduce_params": {"q_norm.weight": ["dp"], "w": ["dp", "tp"]}}}}
    entry = plan_from_dict(two).entries["m"]
    assert entry.grad_reduce_params == ("q_norm.weight", "w")
    assert entry.grad_reduce_axes == (("q_norm.weight", ("dp",)), ("w", ("dp", "tp")))
    # the list form keeps its meaning: every axis the body is sharded on
    assert plan_from_dict(minimal(grad_reduce_params=["w"])).entries["model.layers.*.mlp"].grad_reduce_axes == ()
    two["param_plan"]["m"]["grad_reduce_params"] = {"w": ["ep"]}
    assert "grad_reduce_params.w[0]: unknown axis 'ep' (mesh_dim_names: dp, tp)" in error_of(two)
    two["param_plan"]["m"]["grad_reduce_params"] = {"w": []}
    assert "grad_reduce_params.w: names no axis to sum over" in error_of(two)
