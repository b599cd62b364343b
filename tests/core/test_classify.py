"""The transition table, composition over axes, backward conjugates, gates and forms."""

import textwrap

import pytest

from hpgen.core.classify import classify_contract, transition, value_ops
from hpgen.generator.index import index_module, parse_source
from hpgen.generator.index_records import ChildArgument
from hpgen.core.placement import Placement
from hpgen.core.plan import plan_from_dict

P = Placement.parse


def op(src, dst, *, side="out", sharded=True):
    return transition("tp", "x", P(src), P(dst), side=side, sharded_body=sharded)


@pytest.mark.parametrize(
    ("src", "dst", "kind", "args"),
    [
        ("R", "R", "identity", ()),
        ("S(1)", "S(1)", "identity", ()),
        ("P(sum)", "P(sum)", "identity", ()),
        ("S(1)", "R", "all_gather", (("dim", 1),)),
        ("S(-1)", "R", "all_gather", (("dim", -1),)),
        ("P(sum)", "R", "all_reduce", (("op", "sum"),)),
        ("P(avg)", "R", "all_reduce", (("op", "avg"),)),
        ("P(max)", "R", "all_reduce", (("op", "max"),)),
        ("P(sum)", "S(0)", "reduce_scatter", (("dim", 0),)),
        ("R", "S(1)", "split", (("dim", 1),)),
        ("S(1)", "S(2)", "all_to_all", (("src_dim", 1), ("dst_dim", 2))),
    ],
)
def test_transition_table(src, dst, kind, args):
    found = op(src, dst)
    assert (found.kind, found.args) == (kind, args)


@pytest.mark.parametrize(
    ("src", "dst", "why"),
    [
        ("SS(0,2)", "R", "strided shards"),
        ("R", "SS(0,2)", "strided shards"),
        ("R", "P(sum)", "partial value"),
        ("S(0)", "P(sum)", "partial value"),
        ("P(max)", "S(0)", "reduce-scatter of P(max)"),
        ("P(sum)", "P(max)", "partial value"),
    ],
)
def test_transitions_without_static_lowering_are_generic(src, dst, why):
    found = op(src, dst)
    assert found.kind == "generic" and why in found.reason


def test_backward_conjugates_follow_the_gradient_placement():
    # Into a sharded body, a replicated input's gradient comes back partial.
    assert op("R", "R", side="in").kind == "copy"
    assert op("R", "R", side="in", sharded=False).kind == "identity"
    assert op("S(1)", "R", side="in").backward is None  # default: reduce_scatter
    assert op("S(1)", "R", side="in", sharded=False).backward == "split"
    # Out to a replicated caller, the gradient is replicated: a gather's backward is a split.
    assert op("S(-1)", "R", side="out").backward == "split"
    assert op("P(sum)", "R", side="out").backward is None  # default: identity
    assert op("P(sum)", "R", side="in").backward == "all_reduce"
    assert op("P(sum)", "S(1)").backward is None  # default: all_gather
    assert op("R", "S(1)", side="in").backward is None  # default: all_gather


def test_comments_name_the_transition():
    assert op("S(1)", "R", side="in").comment() == "x: tp S(1) -> R ==> all_gather(dim=1)"
    assert op("S(-1)", "R").comment() == "x: tp S(-1) -> R ==> all_gather(dim=-1) (backward split)"
    assert op("P(sum)", "R").comment() == "x: tp P(sum) -> R ==> all_reduce(sum)"
    assert op("R", "R", side="in").comment() == "x: tp R -> R ==> copy (backward all_reduce)"
    assert op("S(-1)", "R").call_arguments() == ', dim=-1, backward="split"'


def two_axis_plan():
    return plan_from_dict(
        {
            "mesh_dim_names": ["tp", "sp"],
            "param_plan": {
                "blk": {
                    "in_src": {"h": {"tp": "R", "sp": "S(1)"}},
                    "in_dst": {"h": {"tp": "R", "sp": "R"}},
                    "out_src": {"o": {"tp": "P(sum)", "sp": "R"}},
                    "out_dst": {"o": {"tp": "R", "sp": "S(1)"}},
                }
            },
        }
    )


def test_axes_compose_in_mesh_order_in_and_reverse_order_out():
    inputs, outputs = value_ops(two_axis_plan(), "blk")
    assert [(o.axis, o.kind) for o in inputs[0].ops] == [("tp", "copy"), ("sp", "all_gather")]
    assert [(o.axis, o.kind) for o in outputs[0].ops] == [("sp", "split"), ("tp", "all_reduce")]


def forward_of(source: str):
    source = textwrap.dedent(source)
    return index_module(parse_source(source)).classes["A"].forward


def contract(forward_source: str, **entry):
    plan = plan_from_dict({"mesh_dim_names": ["tp"], "param_plan": {"a": entry}})
    return classify_contract(plan, ("a",), forward_of(forward_source))


OUT = {"out_src": {"o": {"tp": "P(sum)"}}, "out_dst": {"o": {"tp": "R"}}}


def test_tp_collective_when_every_gate_passes():
    found = contract("class A:\n    def forward(self, x):\n        return x\n", **OUT)
    assert found.form == "tp_collective" and not found.reasons
    assert found.outputs[0].address == ("whole",)
    assert found.collectives_per_call() == {"all_reduce": 1}


@pytest.mark.parametrize(
    ("source", "entry", "reason"),
    [
        ("def forward(self, *args):\n        return args[0]", OUT, "forward takes *args"),
        ("def forward(self, x):\n        if x:\n            return\n        return x", OUT, "returns no value"),
        ("def forward(self, x):\n        print(x)", OUT, "forward can end without a return"),
        ("def forward(self, x):\n        if x:\n            return x, x\n        return x", OUT, "different shapes"),
        (
            "def forward(self, **kw):\n        return 1",
            {"in_src": {"h": {"tp": "S(1)"}}, "in_dst": {"h": {"tp": "R"}}},
            "input 'h' is not a parameter of forward",
        ),
        (
            "def forward(self, x):\n        return x, x",
            {"out_names": ["a", "b", "c"], "out_src": {"c": {"tp": "P(sum)"}}},
            "output 'c' is item 2 but the return on line 3 has 2",
        ),
        ("def forward(self, x):\n        return Out(y=x)", OUT, "output 'o' is not a field of the record"),
    ],
)
def test_failed_gates_make_the_form_generic(source, entry, reason):
    found = contract(f"class A:\n    {source}\n", **entry)
    assert found.form == "generic"
    assert any(reason in failure for failure in found.gate_failures), found.gate_failures


def test_output_addresses():
    tuple_source = "class A:\n    def forward(self, x):\n        return x, None\n"
    assert contract(tuple_source, **OUT).outputs[0].address == ("index", 0)
    record = "class A:\n    def forward(self, x):\n        return Out(o=x, cache=None)\n"
    assert contract(record, **OUT).outputs[0].address == ("attr", "o")
    cast = "class A:\n    def forward(self, x):\n        return x.to(dtype=torch.float32)\n"
    found = contract(cast, **OUT)  # a tensor, not a record with a ``dtype`` field
    assert found.form != "generic" and found.outputs[0].address == ("whole",)
    named = {"out_names": ["a", "b"], "out_src": {"b": {"tp": "P(sum)"}}}
    assert contract("class A:\n    def forward(self, x):\n        return y\n", **named).outputs[1].address == ("index", 1)


def test_identity_and_region_forms():
    same = {"in_src": {"x": {"tp": "S(1)"}}, "in_dst": {"x": {"tp": "S(1)"}}}
    assert contract("class A:\n    def forward(self, x):\n        return x\n", **same).form == "identity"
    found = contract("class A:\n    def forward(self, x):\n        return x\n", region_dispatch=True, **OUT)
    assert found.form == "region" and found.region_target == "_forward_impl"


def test_an_output_consumed_on_shards_reduces_its_gradient_too():
    # Mamba's x_proj: the reduced dt, B, C feed the channel-sharded scan, whose gradient comes back partial
    partial = transition("tp", "x", P("P(sum)"), P("R"), side="out", sharded_body=True, partial_caller=True)
    assert (partial.kind, partial.backward) == ("all_reduce", "all_reduce")
    gathered = transition("tp", "x", P("S(-1)"), P("R"), side="out", sharded_body=True, partial_caller=True)
    assert gathered.kind == "all_gather" and gathered.backward is None  # default: reduce_scatter
    plan = plan_from_dict(
        {
            "mesh_dim_names": ["tp"],
            "param_plan": {
                "x_proj": {
                    "in_src": {"input": {"tp": "S(-1)"}},
                    "in_dst": {"input": {"tp": "S(-1)"}},
                    "out_src": {"output": {"tp": "P(sum)"}},
                    "out_dst": {"output": {"tp": "R"}},
                    "params": {"weight": {"tp": "S(1)"}},
                    "out_grad_partial": ["output"],
                }
            },
        }
    )
    _, outputs = value_ops(plan, "x_proj")
    assert [op.comment() for op in outputs[0].ops] == [
        "output: tp P(sum) -> R ==> all_reduce(sum) (backward all_reduce)"
    ]


HANDED_ON_SOURCE = '''
from torch import nn


class Attn(nn.Module):
    def forward(self, x, mask=None):
        return x + mask


class Norm(nn.Module):
    def forward(self, x, bias, gain):
        return x * gain + bias


class Plain(nn.Module):
    def forward(self, x, extra):
        return x * extra


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.norm = Norm()
        self.plain = Plain()

    def forward(self, x, mask, bias, gain, extra, shared, scaled, **kwargs):
        h = self.attn(x, mask=mask)
        h = self.norm(h, bias, gain)
        h = h + self.plain(h, extra) + self.attn(h, scaled)
        scaled = None
        return h * shared + self.attn(h, shared)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(2)])
'''


def test_undeclared_arguments_handed_to_child_boundaries_get_no_copy():
    """A sequence-sharded block's undeclared arguments: the ones its body only hands to child boundaries
    that own their gradients get no copy (a second all-reduce would double the gradient, cpmant's
    position_bias under --sp); the ones it reads itself, or hands to a module without an entry, keep it."""
    from hpgen.generator.lower import analyze, lower

    plan = plan_from_dict(
        {
            "mesh_dim_names": ["tp"],
            "model_class": "Model",
            "param_plan": {
                "layers.*": {"in_src": {"x": {"tp": "R"}}, "in_dst": {"x": {"tp": "S(1)"}}},
                # rewritten (it gathers the sequence): owns mask, declared or not
                "layers.*.attn": {"in_src": {"x": {"tp": "S(1)"}}, "in_dst": {"x": {"tp": "R"}}},
                # an identity contract (bias a per-position one, sharded with the sequence): the class is not
                # rewritten, so it owns only what its entry declares (bias, not gain)
                "layers.*.norm": {
                    "in_src": {"x": {"tp": "S(1)"}, "bias": {"tp": "S(1)"}},
                    "in_dst": {"x": {"tp": "S(1)"}, "bias": {"tp": "S(1)"}},
                },
            },
        }
    )
    block = analyze(textwrap.dedent(HANDED_ON_SOURCE), plan).classes["Block"].contracts[0]
    # gain: an identity child that does not declare it; extra: a module without an entry; shared: the body
    # reads it too; scaled: the body rebinds the name
    assert block.undeclared == ("gain", "extra", "shared", "scaled")
    assert block.undeclared_kwargs is None and block.handed_on == ("mask", "bias", "**kwargs")
    text = lower(textwrap.dedent(HANDED_ON_SOURCE), plan)
    forward = text[text.index("class Block"):text.index("class Model")]
    copied = [line.strip().split(" = ")[0] for line in forward.splitlines() if "copy_if_grad" in line]
    assert copied == ["gain", "extra", "shared", "scaled"]
    # what counts as handing on: a whole argument at a known position, by keyword, or as **mapping
    index = index_module(parse_source(textwrap.dedent('''
        class A:
            def forward(self, a, b, c, d, e, **kw):
                f = lambda c: self.m(c)
                return self.m(a, *d, b, key=e, **kw) + f(1)
    ''')))
    # b: after *d, at no known position; c: a lambda's own parameter shadows it; d: unpacked
    assert dict(index.classes["A"].forward.handed_on) == {
        "a": (ChildArgument("m", position=0),),
        "e": (ChildArgument("m", keyword="key"),),
        "kw": (ChildArgument("m"),),
    }
