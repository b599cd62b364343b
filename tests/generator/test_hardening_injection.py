"""Code injection (issue 7): no plan string reaches the generated file unless validated.

A plan is data that ends up as Python source. Every place of the plan that holds a name
gets payloads that would become code if they were pasted into a template: line breaks,
quotes, triple quotes, comment starts, calls, jinja syntax. Each run through the command
line must either exit 2 with one ``error:`` line and write nothing, or write a file whose
syntax tree holds nothing that came from the payload: no call to ``__import__``,
``system``, ``exec`` or ``eval``, no import the source did not have, and the payload text
nowhere outside comments (tokens of the original source aside). ``_target_`` keyword
arguments never reach the file at all. File names, which the header shows, are escaped.
"""

from __future__ import annotations

import ast
import io
import json
import tokenize
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpgen.cli import cli
from hpgen.core.errors import HpgenError
from hpgen.core.header import HEADER_LINES, display_name, read_header
from hpgen.generator.lower import lower
from hpgen.core.plan import plan_from_dict

from tests.conftest import FIXTURES

SOURCE_TEXT = (FIXTURES / "modeling_tiny.py").read_text()
BASE = json.loads((FIXTURES / "plan_tp.json").read_text())
ATTN, MLP = "model.layers.*.self_attn", "model.layers.*.mlp"

PAYLOADS = [
    "x\nimport os",
    "x\r\nimport os",
    "x\rimport os",
    "x\x0cimport os",
    "x\u2028import os",
    "x; import os",
    "__import__('os').system('echo pwned')",
    "os.system('echo pwned')",
    '"""',
    "'''",
    '"',
    "x'",
    "#",
    "x # comment",
    "x\\\nimport os",
    "{{ 7 * 7 }}",
    "{% import os %}",
    "a.b\nimport os",
    "a.b()",
    "x = 1",
    "lambda: 0",
    "print(1)",
    "\x00",
    "class",
    "x y",
    "é",
]
DANGEROUS_CALLS = {"__import__", "system", "exec", "eval", "compile", "popen", "open", "print"}


def _set(document: dict, path: tuple, value) -> None:
    for part in path[:-1]:
        document = document.setdefault(part, {})
    document[path[-1]] = value


def place(where: str, payload: str) -> dict:
    """The base plan with ``payload`` in one place that names something."""
    plan = json.loads(json.dumps(BASE))
    entries = plan["param_plan"]
    if where == "input name (forward takes **kwargs)":
        entries[ATTN]["in_src"][payload] = {"tp": "S(1)"}
    elif where == "input name":
        entries[MLP]["in_src"] = {payload: {"tp": "S(1)"}}
    elif where == "out_names":
        entries[ATTN]["out_names"] = [payload, "attn_weights"]
        entries[ATTN]["out_src"] = {payload: {"tp": "P(sum)"}}
        entries[ATTN]["out_dst"] = {payload: {"tp": "R"}}
    elif where == "single output name":
        entries[MLP]["out_src"] = {payload: {"tp": "P(sum)"}}
        entries[MLP]["out_dst"] = {payload: {"tp": "R"}}
    elif where == "axis name":
        plan = json.loads(json.dumps(BASE).replace('"tp"', json.dumps(payload)))
    elif where == "tp_divide_attrs":
        entries[ATTN]["tp_divide_attrs"] = [payload]
    elif where == "param path":
        entries[MLP]["params"][payload] = {"tp": "S(0)"}
    elif where == "deferred_bias_params":
        entries[MLP]["deferred_bias_params"] = [payload]
    elif where == "grad_reduce_params":
        entries[MLP]["grad_reduce_params"] = [payload]
    elif where == "placement":
        entries[MLP]["in_src"]["x"] = {"tp": "S(1)" + payload}
    elif where == "local_compute_fn":
        plan["injections"] = [{"match": MLP, "local_compute_fn": payload}]
    elif where == "_target_":
        plan["injections"] = [{"match": MLP, "local_compute_fn": {"_target_": payload}}]
    elif where == "inner_wrapper":
        plan["injections"] = [{"match": MLP, "local_compute_fn": "pkg.fn", "inner_wrapper": payload}]
    elif where == "_target_ kwarg name":
        plan["injections"] = [{"match": MLP, "local_compute_fn": {"_target_": "pkg.fn", payload: 1}}]
    elif where == "injection match":
        plan["injections"] = [{"match": payload, "local_compute_fn": "pkg.fn"}]
    elif where == "boundary_classes class":
        plan["boundary_classes"] = {MLP: payload}
    elif where == "boundary_classes key":
        plan["boundary_classes"] = {payload: "TinyMLP"}
    elif where == "model_class":
        plan["model_class"] = payload
    elif where == "FQN key":
        entries[payload] = entries.pop(MLP)
    elif where == "FQN key segment":
        entries[f"model.layers.{payload}.mlp"] = entries.pop(MLP)
    elif where == "format":
        plan["format"] = payload
    else:
        raise AssertionError(where)
    return plan


PLACES = [
    "input name (forward takes **kwargs)",
    "input name",
    "out_names",
    "single output name",
    "axis name",
    "tp_divide_attrs",
    "param path",
    "deferred_bias_params",
    "grad_reduce_params",
    "placement",
    "local_compute_fn",
    "_target_",
    "inner_wrapper",
    "_target_ kwarg name",
    "injection match",
    "boundary_classes class",
    "boundary_classes key",
    "model_class",
    "FQN key",
    "FQN key segment",
    "format",
]


def lower_cli(tmp_path: Path, plan_bytes: bytes, *, source_name="modeling.py", plan_name="plan.json", mode="default"):
    source, plan, out = tmp_path / source_name, tmp_path / plan_name, tmp_path / "out.py"
    source.write_text(SOURCE_TEXT)
    plan.write_bytes(plan_bytes)
    result = CliRunner().invoke(cli, ["lower", str(source), str(plan), "-o", str(out), "--mode", mode])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code in (0, 2), (result.exit_code, result.stderr)
    if result.exit_code == 2:
        assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1, repr(result.stderr)
        assert not out.exists()
        return None
    return out.read_text()


def code_tokens(text: str) -> list[str]:
    """Every token of ``text`` except comments, line breaks and indentation."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    return [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type not in skip]


ORIGINAL_TOKENS = set(code_tokens(SOURCE_TEXT))
ORIGINAL_IMPORTS = {ast.dump(node) for node in ast.walk(ast.parse(SOURCE_TEXT)) if isinstance(node, (ast.Import, ast.ImportFrom))}


def assert_no_injected_code(output: str) -> None:
    """No call of ``__import__``/``system``/``exec``/``eval``/..., no import the source lacks."""
    for node in ast.walk(ast.parse(output)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            assert name not in DANGEROUS_CALLS, ast.unparse(node)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            assert ast.dump(node) in ORIGINAL_IMPORTS or ast.unparse(node) == "import hpgen.runtime.defaults as _hp_runtime"


def assert_payload_inert(output: str, payload: str) -> None:
    """The generated file holds no code that came from ``payload``: the payload's text is in
    no token outside comments, except tokens the original source has itself."""
    assert_no_injected_code(output)
    for token in code_tokens(output):
        assert payload not in token or token in ORIGINAL_TOKENS, f"payload {payload!r} reached code: {token!r}"


def could_be_a_name(payload: str) -> bool:
    """True when ``payload`` is made of identifier characters and dots only."""
    return all(part.isidentifier() for part in payload.split("."))


@pytest.mark.parametrize("where", PLACES)
def test_payloads_in_every_named_place_are_refused_or_inert(where, tmp_path):
    """Each payload in each place: exit 2 with one line, or a file with no code from it; a
    payload with characters no name can hold (line breaks, quotes, spaces...) is always refused."""
    for number, payload in enumerate(PAYLOADS):
        folder = tmp_path / str(number)
        folder.mkdir()
        output = lower_cli(folder, json.dumps(place(where, payload)).encode())
        if output is not None:
            assert could_be_a_name(payload), f"{where}: {payload!r} was accepted"
            assert_payload_inert(output, payload)


# Identifiers and dotted paths that name something dangerous: they are valid names, so
# they may be accepted, but only as names (in strings, comments, subscripts), never called.
NAMED_DANGERS = {
    "input name (forward takes **kwargs)": "eval",
    "out_names": "system",
    "single output name": "exec",
    "axis name": "eval",
    "local_compute_fn": "os.system",
    "_target_": "builtins.eval",
    "tp_divide_attrs": "system",
}


@pytest.mark.parametrize("mode", ["default", "toggle"])
@pytest.mark.parametrize("where", sorted(NAMED_DANGERS))
def test_dangerous_but_valid_names_are_never_called(where, mode, tmp_path):
    """A valid name such as ``os.system`` or ``eval`` may reach the file only as data or a comment."""
    payload = NAMED_DANGERS[where]
    output = lower_cli(tmp_path, json.dumps(place(where, payload)).encode(), mode=mode)
    assert output is not None, "a valid identifier or dotted path must be accepted"
    assert_no_injected_code(output)
    tree = ast.parse(output)
    called = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not any(payload in name.split(".") or name == payload for name in called), called


def test_target_kwargs_never_reach_the_generated_file(tmp_path):
    """``_target_`` keyword arguments are runtime data: neither names nor values appear in the file."""
    plan = json.loads(json.dumps(BASE))
    plan["injections"] = [
        {
            "match": MLP,
            "local_compute_fn": {
                "_target_": "tests.local_fns.scaled_mlp",
                "marker_kwarg_name": "MARKER_VALUE\nimport os\n'''\"\"\"#",
                "nested": {"MARKER_NESTED": ["__import__('os').system('echo pwned')"]},
            },
        }
    ]
    output = lower_cli(tmp_path, json.dumps(plan).encode())
    assert output is not None and '_hp_boundary_form = "region"' in output
    for marker in ("marker_kwarg_name", "MARKER_VALUE", "MARKER_NESTED", "pwned"):
        assert marker not in output
    assert_payload_inert(output, "import os")


FILE_NAMES = [
    'modeling\nimport os\n.py',
    'modeling"""#.py',
    "modeling'.py",
    "modeling\u2028import os.py",
    "modeling\x1b[31m.py",
    "modeling\r.py",
    "modéling 日本.py",
]


@pytest.mark.parametrize("name", FILE_NAMES, ids=[ascii(name) for name in FILE_NAMES])
def test_hostile_file_names_are_escaped_in_the_header(name, tmp_path):
    """Source and plan names reach only the header's comments, escaped: the code is the same
    as with plain names, the header keeps its lines, and it reads back to the same names."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "hostile").mkdir()
    plain = lower_cli(tmp_path / "plain", json.dumps(BASE).encode())
    plan_name = name.replace("modeling", "plan").replace(".py", ".json")
    output = lower_cli(tmp_path / "hostile", json.dumps(BASE).encode(), source_name=name, plan_name=plan_name)
    assert output is not None
    assert ast.dump(ast.parse(output)) == ast.dump(ast.parse(plain))
    lines = output.splitlines(keepends=True)
    assert lines[HEADER_LINES:] == plain.splitlines(keepends=True)[HEADER_LINES:]
    header_tokens = list(tokenize.generate_tokens(io.StringIO("".join(lines[:HEADER_LINES])).readline))
    assert {tok.type for tok in header_tokens} <= {tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER}
    assert all(line.isprintable() for line in "".join(lines[:HEADER_LINES]).split("\n")[:-1])
    header = read_header(output)
    assert header is not None
    assert (header.source_name, header.plan_name) == (display_name(name), display_name(plan_name))


def test_the_pure_api_refuses_or_escapes_what_reaches_the_header():
    """``lower()`` itself (not only the CLI) refuses a package that is no dotted name and
    escapes source and plan names: the header is the only place they reach."""
    plan = plan_from_dict(BASE, name="plan\nimport os\n.json")
    for package in ("x\nimport os", "a b", "pkg.class", "pkg..x", ""):
        with pytest.raises(HpgenError, match="is not a dotted package name"):
            lower(SOURCE_TEXT, plan, package=package)
    with pytest.raises(HpgenError, match="unknown mode"):
        lower(SOURCE_TEXT, plan, mode="default\nimport os")
    output = lower(SOURCE_TEXT, plan, source_name="m\nimport os\n.py", package="transformers.models.tiny")
    assert_payload_inert(output, "import os")
    assert len([line for line in output.splitlines() if "import os" in line]) == 2  # the two escaped names
    assert all(line.startswith("# ") for line in output.splitlines() if "import os" in line)


def test_an_error_about_a_file_with_a_hostile_name_stays_one_line(tmp_path):
    """Errors name the file; a line break in its name must not break the one-line message."""
    source = tmp_path / "bad\nname.py"
    source.write_text("def f(:\n")
    result = CliRunner().invoke(cli, ["lower", str(source), str(FIXTURES / "plan_tp.json"), "-o", str(tmp_path / "o.py")])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1, repr(result.stderr)
