"""Hostile and random plans (issue 7): properties that must hold for every plan.

Valid plans are drawn at random over the bundled fixture (every boundary it offers, 1-3
mesh axes with random names, every placement of the grammar, injections, flags, both
modes). Whatever they say, the generated file parses and compiles, every class that is
not rewritten is byte-identical, every rewritten class keeps its original ``forward``
body byte for byte as ``_forward_impl``, the output does not depend on the plan's key
order, and, run without ``parallelize``, it computes what the original computes.

Mutations of valid plans (wrong JSON types, missing keys, odd placements, hostile names,
huge numbers, nested garbage, broken JSON text) go through the real command line: each
run either succeeds with a valid file or exits 2 with one ``error:`` line on stderr and
writes nothing; never a traceback, never exit 1.

Hypothesis runs derandomized with a modest number of examples, so CI is reproducible.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from hpgen.cli import cli
from hpgen.core.errors import HpgenError
from hpgen.generator.lower import analyze, lower
from hpgen.core.placement import Placement
from hpgen.core.plan import RESERVED_AXIS_NAMES, is_identifier, plan_from_dict

from tests.conftest import FIXTURES, PLANS
from tests.support.modules import load_module

SOURCE_PATH = FIXTURES / "modeling_tiny.py"
SOURCE = SOURCE_PATH.read_text()
RUNTIME_IMPORT = "import hpgen.runtime.defaults as _hp_runtime"
SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
}


# --------------------------------------------------------------------------- the fixture's boundaries


@dataclass(frozen=True)
class Site:
    """A boundary the fixture offers: its class and what its ``forward`` takes and returns."""

    cls: str  # class name in the fixture, or the external class
    params: tuple[str, ...]  # forward parameters other than self
    takes_kwargs: bool
    external: bool = False
    returns: int = 1  # values the forward returns: a tuple of that many, or one tensor


SITES = {
    "attn": Site("TinyAttention", ("hidden_states", "position_embeddings", "attention_mask"), True, returns=2),
    "mlp": Site("TinyMLP", ("x",), False),
    "layer": Site("TinyDecoderLayer", ("hidden_states", "position_embeddings", "attention_mask"), False),
    "norm": Site("TinyRMSNorm", ("hidden_states",), False),
    "rotary": Site("TinyRotaryEmbedding", ("x", "position_ids"), False, returns=2),
    "embedding": Site("nn.Embedding", ("input",), True, external=True),
    "linear": Site("nn.Linear", ("input",), True, external=True),
}

# Each group lists mutually exclusive choices of keys (keys of one group overlap).
GROUPS = [
    [(), ("model.layers.*.self_attn",), ("model.layers.0.self_attn",), ("model.layers.0.self_attn", "model.layers.1.self_attn")],
    [(), ("model.layers.*.mlp",), ("model.layers.1.mlp",), ("model.layers.0.mlp", "model.layers.1.mlp")],
    [(), ("model.layers.*",), ("model.layers.0",), ("model.layers.0", "model.layers.1")],
    [(), ("model.layers.*.input_layernorm",), ("model.layers.1.input_layernorm",)],
    [(), ("model.layers.*.post_attention_layernorm",)],
    [(), ("model.norm",)],
    [(), ("model.rotary_emb",)],
    [(), ("model.embed_tokens",)],
    [(), ("lm_head",)],
]


def site_of(key: str) -> Site:
    last = key.rsplit(".", 1)[-1]
    if key.startswith("model.layers.") and (last.isdigit() or last == "*"):
        return SITES["layer"]
    return SITES[
        {
            "self_attn": "attn",
            "mlp": "mlp",
            "input_layernorm": "norm",
            "post_attention_layernorm": "norm",
            "norm": "norm",
            "rotary_emb": "rotary",
            "embed_tokens": "embedding",
            "lm_head": "linear",
        }[last]
    ]


# --------------------------------------------------------------------------- valid plans

IDENT = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True).filter(is_identifier)
AXIS = IDENT.filter(lambda name: name not in RESERVED_AXIS_NAMES and not name.startswith("__"))


def placements(ndim: int = 4) -> st.SearchStrategy[str]:
    """A placement whose dims a tensor of ``ndim`` dims has."""
    dim = st.integers(-ndim, ndim - 1)
    return st.one_of(
        st.just("R"),
        dim.map(lambda d: f"S({d})"),
        st.sampled_from(["sum", "avg", "max", "min"]).map(lambda op: f"P({op})"),
        st.tuples(dim, st.integers(1, 4)).map(lambda dk: f"SS({dk[0]},{dk[1]})"),
    )


def parameters_of(key: str) -> dict[str, int]:
    """The parameters (path -> dims) of the fixture's module at ``key``: a plan names real ones
    (``hpgen lower`` refuses a name the source shows does not exist)."""
    module = REFERENCE_MODEL.get_submodule(key.replace("*", "0"))
    return {name: parameter.dim() for name, parameter in module.named_parameters()}

JSON_VALUE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.text(max_size=6)),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
    max_leaves=4,
)


@st.composite
def valid_plans(draw) -> dict:
    """A random plan document that hpgen must accept for the fixture."""
    mesh = draw(st.lists(st.one_of(st.just("tp"), AXIS), min_size=1, max_size=3, unique=True))

    def layout(ndim: int = 4) -> dict:
        axes = draw(st.lists(st.sampled_from(mesh), unique=True, max_size=len(mesh)))
        return {axis: draw(placements(ndim)) for axis in axes}

    def layouts(names: list[str]) -> dict:
        chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)))
        return {name: layout() for name in chosen}

    entries: dict[str, dict] = {}
    boundary_classes: dict[str, str] = {}
    injections = []
    for group in GROUPS:
        for key in draw(st.sampled_from(group)):
            site = site_of(key)
            inputs = set(site.params)
            if site.takes_kwargs:
                inputs |= set(draw(st.lists(IDENT.filter(lambda n: n not in ("self", "kwargs")), max_size=2)))
            inputs = sorted(inputs)
            entry: dict = {}
            for part in ("in_src", "in_dst"):
                if draw(st.booleans()):
                    entry[part] = layouts(inputs)
            if draw(st.booleans()):
                # as many names as the forward returns at most: a plan naming outputs the class does
                # not return describes another model (its ops would index into a tensor)
                outputs = draw(st.lists(IDENT, min_size=1, max_size=site.returns, unique=True))
                entry["out_names"] = outputs
            else:
                outputs = [draw(IDENT)]
            for part in ("out_src", "out_dst"):
                if draw(st.booleans()):
                    entry[part] = layouts(outputs)
            owned = parameters_of(key)
            names = st.sampled_from(sorted(owned))
            if owned and draw(st.booleans()):
                entry["params"] = {path: layout(owned[path]) for path in draw(st.lists(names, unique=True, max_size=3))}
            for part in ("deferred_bias_params", "grad_reduce_params"):
                if owned and draw(st.integers(0, 3)) == 0:
                    entry[part] = draw(st.lists(names, unique=True, max_size=2))
            if "tp" in mesh and draw(st.integers(0, 3)) == 0:
                entry["tp_divide_attrs"] = draw(st.lists(IDENT, unique=True, max_size=2))
            for flag, odds in (("is_boundary", 4), ("region_dispatch", 4), ("skip_source_lowering", 8)):
                if draw(st.integers(0, odds - 1)) == 0:
                    entry[flag] = draw(st.booleans())
            entries[key] = entry
            if draw(st.integers(0, 3)) == 0:
                boundary_classes[key] = site.cls if not site.external else "torch." + site.cls
            if draw(st.integers(0, 3)) == 0:
                path = draw(st.lists(IDENT, min_size=1, max_size=3).map(".".join))
                target = path
                if draw(st.booleans()):
                    kwargs = draw(st.dictionaries(IDENT.filter(lambda n: n != "_target_"), JSON_VALUE, max_size=2))
                    target = {"_target_": path, **kwargs}
                injections.append({"match": key, "local_compute_fn": target})
    document: dict = {"mesh_dim_names": mesh, "param_plan": entries}
    if draw(st.booleans()):
        document["model_class"] = "TinyForCausalLM"
    if boundary_classes:
        document["boundary_classes"] = boundary_classes
    if injections:
        document["injections"] = injections
    if draw(st.booleans()):
        document["format"] = "hpgen.plan/1"
    if draw(st.integers(0, 3)) == 0:
        document["codegen_version"] = draw(JSON_VALUE)  # unknown top-level keys are ignored
    return document


def moves(entry: dict, mesh: list[str]) -> bool:
    """Oracle, independent of hpgen's classifier: does some declared value change layout, or
    does a declared replicated input enter a body sharded on that axis (a ``copy``: identity
    forward, its gradient all-reduced, so the class must be rewritten for it)?"""
    def on(layout: dict, axis: str) -> Placement:
        return Placement.parse(layout.get(axis, "R"))

    sharded = {
        axis
        for axis in mesh
        for part in ("in_dst", "out_src", "params")
        for layout in entry.get(part, {}).values()
        if not on(layout, axis).is_replicate
    }
    for src_part, dst_part in (("in_src", "in_dst"), ("out_src", "out_dst")):
        src, dst = entry.get(src_part, {}), entry.get(dst_part, {})
        for name in {*src, *dst}:
            for axis in mesh:
                before, after = on(src.get(name, {}), axis), on(dst.get(name, {}), axis)
                if before != after or (src_part == "in_src" and after.is_replicate and axis in sharded):
                    return True
    return False


def expected_rewritten(document: dict) -> set[str]:
    """The fixture classes that the plan must make hpgen rewrite."""
    injected = {injection["match"] for injection in document.get("injections", [])}
    found = set()
    for key, entry in document["param_plan"].items():
        has_io = any(entry.get(part) for part in ("in_src", "in_dst", "out_src", "out_dst"))
        if not entry.get("is_boundary", has_io) or entry.get("skip_source_lowering", False):
            continue
        site = site_of(key)
        if site.external:
            continue
        if key in injected or entry.get("region_dispatch", False) or moves(entry, document["mesh_dim_names"]):
            found.add(site.cls)
    return found


def reversed_keys(value):
    """The same JSON value with every object's keys in reverse order."""
    if isinstance(value, dict):
        return {key: reversed_keys(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [reversed_keys(item) for item in value]
    return value


# --------------------------------------------------------------------------- checks on the output


def top_level_classes(module: cst.Module) -> dict[str, cst.ClassDef]:
    return {statement.name.value: statement for statement in module.body if isinstance(statement, cst.ClassDef)}


def method(node: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    found = [s for s in node.body.body if isinstance(s, cst.FunctionDef) and s.name.value == name]
    assert len(found) <= 1, f"{node.name.value} defines {name} {len(found)} times"
    return found[0] if found else None


ORIGINAL_TREE = cst.parse_module(SOURCE)


def check_output(output: str, rewritten: set[str]) -> None:
    """The structural properties every lowering of the fixture must have."""
    compile(output, "generated.py", "exec", dont_inherit=True)
    original, generated = ORIGINAL_TREE, cst.parse_module(output)
    code = original.code_for_node
    before, after = top_level_classes(original), top_level_classes(generated)
    # Statements other than classes are untouched, apart from the one runtime import.
    others = [code(s) for s in generated.body if not isinstance(s, cst.ClassDef) and code(s).strip() != RUNTIME_IMPORT]
    assert others == [code(s) for s in original.body if not isinstance(s, cst.ClassDef)]
    assert (RUNTIME_IMPORT + "\n" in output) == bool(rewritten)
    assert [name for name in after if name in before] == list(before)
    for name, node in before.items():
        if name not in rewritten:
            assert code(after[name]) == code(node), f"{name} is not a boundary class but changed"
            continue
        forward, impl, new = method(node, "forward"), method(after[name], "_forward_impl"), method(after[name], "forward")
        assert impl is not None and new is not None, f"{name} should be rewritten"
        assert code(impl.body) == code(forward.body), f"{name}._forward_impl is not the original body"
        assert code(impl.params) == code(forward.params) == code(new.params)
        assert [code(d) for d in new.decorators] == [code(d) for d in forward.decorators]
        assert impl.decorators == ()
    for name in set(after) - set(before):
        match = re.fullmatch(r"(\w+?)_hp\d+_*", name)
        assert match and match.group(1) in rewritten, f"unexpected new class {name}"
        assert [code(base.value) for base in after[name].bases] == [match.group(1)]
        assert method(after[name], "forward") is not None and method(after[name], "_forward_impl") is None


ORIGINAL = load_module(SOURCE)
INPUT_IDS = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 0, 95, 6]])
torch.manual_seed(0)
REFERENCE_MODEL = ORIGINAL.TinyForCausalLM(ORIGINAL.TinyConfig())
REFERENCE_STATE = REFERENCE_MODEL.state_dict()
with torch.no_grad():
    REFERENCE_LOGITS = REFERENCE_MODEL(INPUT_IDS)


def run_generated(output: str) -> torch.Tensor:
    """Logits of the generated file's model with the reference weights, no parallelize."""
    module = load_module(output)
    model = module.TinyForCausalLM(module.TinyConfig())
    model.load_state_dict(REFERENCE_STATE)
    with torch.no_grad():
        return model(INPUT_IDS)


# --------------------------------------------------------------------------- properties of valid plans


@settings(max_examples=20, **SETTINGS)
@given(document=valid_plans(), mode=st.sampled_from(["default", "toggle"]))
def test_random_valid_plans_lower_to_code_that_keeps_everything_else(document, mode):
    """Any valid plan: output compiles, exactly the boundary classes whose values move are
    rewritten, every other class and every forward body stays byte-identical."""
    plan = plan_from_dict(document, name="plan.json")
    output = lower(SOURCE, plan, mode=mode, source_name="modeling_tiny.py")
    check_output(output, expected_rewritten(document))


@settings(max_examples=10, **SETTINGS)
@given(document=valid_plans(), mode=st.sampled_from(["default", "toggle"]))
def test_random_valid_plans_give_the_same_bytes_whatever_the_key_order(document, mode):
    """docs/generated-code.md: the generated file is byte-identical whatever the key order of the plan."""
    first = lower(SOURCE, plan_from_dict(document), mode=mode)
    assert lower(SOURCE, plan_from_dict(reversed_keys(document)), mode=mode) == first


@settings(max_examples=10, **SETTINGS)
@given(document=valid_plans(), mode=st.sampled_from(["default", "toggle"]))
def test_random_valid_plans_compute_what_the_original_computes(document, mode):
    """Without parallelize the class-level defaults are identities: same logits as the original."""
    output = lower(SOURCE, plan_from_dict(document), mode=mode, source_name="modeling_tiny.py")
    assert torch.equal(run_generated(output), REFERENCE_LOGITS)


def test_a_region_input_that_arrives_in_kwargs_and_is_not_passed_is_left_alone():
    """Found by the property above: a declared input only ``**kwargs`` can carry gets its op
    (here the ``copy`` of a replicated input into a sharded body) only when it is passed."""
    document = {
        "format": "hpgen.plan/1",
        "mesh_dim_names": ["dp", "tp"],
        "param_plan": {
            "model.layers.0.self_attn": {
                "in_src": {"hidden_states": {}, "extra": {}},
                "params": {"q_proj.weight": {"dp": "S(0)"}},
                "region_dispatch": True,
            }
        },
    }
    output = lower(SOURCE, plan_from_dict(document), source_name="modeling_tiny.py")
    assert 'if "extra" in kwargs:' in output
    assert torch.equal(run_generated(output), REFERENCE_LOGITS)


def test_the_valid_plan_strategy_reaches_every_form_and_boundary():
    """Guards the generator of the properties above: it must produce every form and rewrite
    every fixture class, or the properties would be checked on too little. The search stops
    once all are seen (up to 400 plans), so the guard does not hang on how many plans one run
    happens to need, which depends on what Hypothesis ran before it."""
    wanted_forms = {"tp_collective", "generic", "region"}
    wanted_classes = {"TinyAttention", "TinyMLP", "TinyDecoderLayer", "TinyRMSNorm", "TinyRotaryEmbedding"}
    forms, classes = set(), set()

    def all_seen(document: dict) -> bool:
        analysis = analyze(SOURCE, plan_from_dict(document))
        forms.update(contract.form for lowering in analysis.classes.values() for contract in lowering.contracts)
        classes.update(expected_rewritten(document))
        return forms >= wanted_forms and classes >= wanted_classes

    with contextlib.suppress(NoSuchExample):
        find(valid_plans(), all_seen, settings=settings(max_examples=400, phases=[Phase.generate], **SETTINGS))
    assert forms == wanted_forms
    assert classes == wanted_classes


# --------------------------------------------------------------------------- mutations through the CLI

HOSTILE_STRINGS = [
    "",
    " ",
    "a b",
    "x\nimport os",
    "x'",
    'x"',
    '"""',
    "#",
    "class",
    "None",
    "True",
    "self",
    "kwargs",
    "runtime",
    "é",
    "日本",
    "*args",
    "**kwargs",
    "a..b",
    ".a",
    "a.",
    "1abc",
    "model.layers.*",
    "model.layers.**.mlp",
    "S(0",
    "S()",
    "S(1.5)",
    "S(0x1)",
    "S(1)S(2)",
    "P(prod)",
    "P()",
    "SS(0)",
    "SS(0,0)",
    "SS(0,-1)",
    "s(0)",
    " R ",
    "R\n",
    "S( -1 )",
    "S(99999999999999999999)",
    "S(" + "9" * 5000 + ")",
    "\x00",
    "\u2028",
    "tp\u2029",
    "\ud800",
    "__import__('os').system('echo pwned')",
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.just(10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(HOSTILE_STRINGS),
    st.text(max_size=6),
)
GARBAGE = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(HOSTILE_STRINGS) | st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
BASE_PLANS = [
    json.loads(path.read_text())
    for path in (FIXTURES / "plan_tp.json", FIXTURES / "plan_tp_sp.json", *sorted(PLANS.glob("tiny_*.json")))
]


def all_paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from all_paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from all_paths(item, (*path, index))


@st.composite
def mutated_plan_bytes(draw) -> bytes:
    """A valid plan with 0-3 random mutations, as the bytes of a plan file.

    Zero mutations (the plan re-encoded, perhaps damaged as text) keeps valid plans in the
    stream, so the property sees both outcomes whatever Hypothesis draws first.
    """
    holder = {"plan": copy.deepcopy(draw(st.one_of(st.sampled_from(BASE_PLANS), valid_plans())))}
    for _ in range(draw(st.sampled_from([1, 2, 3, 0]))):
        # Not the root and not the whole plan: Hypothesis favours the first element of a
        # sample, and replacing the plan itself would make most examples one trivial error.
        path = draw(st.sampled_from(list(all_paths(holder))[2:] or [("plan",)]))
        action = draw(st.sampled_from(["replace", "delete", "rename", "insert", "wrap", "suffix"]))
        parent = holder
        for part in path[:-1]:
            parent = parent[part]
        last, value = path[-1], parent[path[-1]]
        if action == "replace":
            parent[last] = draw(GARBAGE)
        elif action == "delete" and parent is not holder:
            del parent[last]
        elif action == "rename" and isinstance(parent, dict) and parent is not holder:
            parent[draw(st.sampled_from(HOSTILE_STRINGS) | st.text(max_size=5))] = parent.pop(last)
        elif action == "insert" and isinstance(value, dict):
            value[draw(st.sampled_from(HOSTILE_STRINGS) | IDENT)] = draw(GARBAGE)
        elif action == "wrap":
            parent[last] = draw(st.sampled_from([[value], {"x": value}]))
        elif action == "suffix" and isinstance(value, str):
            parent[last] = value + draw(st.sampled_from(HOSTILE_STRINGS))
        else:
            parent[last] = draw(GARBAGE)
    text = json.dumps(holder["plan"], ensure_ascii=draw(st.booleans()))
    data = text.encode("utf-8", "surrogatepass")
    damage = draw(st.sampled_from(["none"] * 6 + ["truncate", "byte", "bom"]))
    if damage == "truncate":
        data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
    elif damage == "byte":
        position = draw(st.integers(0, len(data)))
        data = data[:position] + bytes([draw(st.integers(0, 255))]) + data[position:]
    elif damage == "bom":
        data = b"\xef\xbb\xbf" + data
    return data


def assert_clean_outcome(result, folder: Path, out: Path, inputs: set[str]) -> str:
    """Exit 0 with a valid file, or exit 2 with one ``error:`` line and nothing written."""
    assert result.exit_code in (0, 2), (result.exit_code, result.stderr, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    leftovers = {path.name for path in folder.iterdir()} - inputs
    if result.exit_code == 2:
        assert result.stderr.startswith("error: "), result.stderr
        assert result.stderr.endswith("\n") and len(result.stderr.splitlines()) == 1, repr(result.stderr)
        assert "\r" not in result.stderr
        assert result.stdout == ""
        assert leftovers == set(), leftovers
        return "error"
    assert leftovers == {out.name}, leftovers
    text = out.read_text()
    compile(text, str(out), "exec", dont_inherit=True)
    assert text.startswith("# Generated by hpgen ")
    return "ok"


@settings(max_examples=100, **SETTINGS)
@given(data=mutated_plan_bytes(), mode=st.sampled_from(["default", "toggle"]))
def test_mutated_plans_through_the_cli_succeed_or_exit_2_with_one_line(data, mode):
    """A mutated plan never yields a traceback, exit 1, a multi-line message or a file on exit 2."""
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        source, plan, out = folder / "modeling.py", folder / "plan.json", folder / "out.py"
        source.write_text(SOURCE)
        plan.write_bytes(data)
        result = CliRunner().invoke(cli, ["lower", str(source), str(plan), "-o", str(out), "--mode", mode])
        assert_clean_outcome(result, folder, out, {source.name, plan.name})


def test_the_mutation_strategy_reaches_both_outcomes():
    """Guards the mutation property: its inputs must both pass and fail, and fail in many places."""
    outcomes, messages = set(), set()

    @settings(max_examples=40, **SETTINGS)
    @given(data=mutated_plan_bytes())
    def collect(data):
        with tempfile.TemporaryDirectory() as name:
            folder = Path(name)
            (folder / "m.py").write_text(SOURCE)
            (folder / "p.json").write_bytes(data)
            result = CliRunner().invoke(cli, ["lower", str(folder / "m.py"), str(folder / "p.json"), "-o", str(folder / "o.py")])
            outcomes.add(assert_clean_outcome(result, folder, folder / "o.py", {"m.py", "p.json"}))
            if result.exit_code == 2:
                messages.add(result.stderr.replace(str(folder), "")[:60])

    collect()
    assert outcomes == {"ok", "error"}, sorted(messages)
    assert len(messages) >= 8, messages


# --------------------------------------------------------------------------- plans that used to slip through

REGRESSIONS = {
    # json.loads raises a plain ValueError (no JSONDecodeError) past 4300 digits: it was a traceback.
    "an integer too long for int()": (
        '{"mesh_dim_names": ["tp"], "param_plan": {}, "x": ' + "1" * 5000 + "}",
        "plan.json: invalid JSON: Exceeds the limit (4300 digits) for integer string conversion",
    ),
    # The JSON path of a key kept U+2028 raw: a line separator inside the one-line message.
    "a line separator in a key": (
        json.dumps({"mesh_dim_names": ["tp"], "param_plan": {"model.layers.*.mlp\u2028x": {}}}, ensure_ascii=False),
        'plan.json:param_plan["model.layers.*.mlp\\u2028x"]: ',
    ),
    # _hp_runtime on a class shadowed the module alias the next default line reads: the file did not import.
    "an axis named runtime": (
        json.dumps({"mesh_dim_names": ["tp", "runtime"], "param_plan": {}}),
        "plan.json:mesh_dim_names[1]: 'runtime' is reserved: _hp_runtime is an attribute hpgen uses itself",
    ),
    # _hp_contract = IDENTITY_AXIS replaced the contract the runtime checks staleness with.
    "an axis named contract": (
        json.dumps({"mesh_dim_names": ["contract"], "param_plan": {}}),
        "plan.json:mesh_dim_names[0]: 'contract' is reserved",
    ),
    # Inside a class, Python mangles self.__x_enable: parallelize could never switch the axis on.
    "an axis named with a leading double underscore": (
        json.dumps({"mesh_dim_names": ["tp", "__x"], "param_plan": {}}),
        "plan.json:mesh_dim_names[1]: '__x' starts with '__', which Python mangles in classes",
    ),
}


@pytest.mark.parametrize("case", sorted(REGRESSIONS))
def test_plans_that_used_to_crash_or_generate_broken_code_exit_2(case, tmp_path):
    """Bugs found by the properties above, kept as fixed examples: exit 2, one located line."""
    text, expected = REGRESSIONS[case]
    (tmp_path / "plan.json").write_text(text, encoding="utf-8")
    result = CliRunner().invoke(cli, ["lower", str(SOURCE_PATH), str(tmp_path / "plan.json"), "-o", str(tmp_path / "out.py")])
    assert assert_clean_outcome(result, tmp_path, tmp_path / "out.py", {"plan.json"}) == "error"
    assert expected in result.stderr, result.stderr


@pytest.mark.parametrize("axis", sorted(RESERVED_AXIS_NAMES - {"runtime", "contract"}))
def test_every_reserved_axis_name_is_refused(axis):
    """No axis may be called like one of hpgen's own ``_hp_`` attributes."""
    with pytest.raises(HpgenError, match=rf"mesh_dim_names\[0\]: '{axis}' is reserved"):
        plan_from_dict({"mesh_dim_names": [axis], "param_plan": {}})
