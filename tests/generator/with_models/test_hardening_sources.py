"""Hostile sources (issue 7): odd but valid modeling files lower correctly, bad ones exit 2.

Each variant of the bundled fixture below is valid Python that computes the same thing
written in another style: tabs, CRLF, CR, a BOM, form feeds, mixed indentation between
classes, stacked decorators with comments, position-only and keyword-only parameters,
``*args``, a parameter named ``outputs``, nested functions and classes, ``try/finally``,
a one-line forward... Each goes through the real command line and must give a file that
compiles, keeps the source's line endings and encoding, is refused as a source in turn,
and, run without ``parallelize``, gives the same logits as the variant itself.

Sources that hpgen cannot rewrite faithfully exit 2 with one line naming the line.
(tests/generator/test_source_styles.py and tests/cli/test_cli.py hold the simpler cases.)
"""

from __future__ import annotations

import json
import re
import textwrap
import types

import libcst as cst
import pytest
import torch
from click.testing import CliRunner

from hpgen.cli import cli

from tests.conftest import FIXTURES, PLANS
from tests.support.modules import load_module

FIXTURE = (FIXTURES / "modeling_tiny.py").read_text()
MLP_FORWARD = (
    "    def forward(self, x):\n"
    "        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # gated, as in Llama\n"
)
MLP_INIT = "    def __init__(self, config: TinyConfig):\n        super().__init__()\n        self.gate_proj"
MLP_INIT_AND_FORWARD = FIXTURE[FIXTURE.index(MLP_INIT) : FIXTURE.index(MLP_FORWARD) + len(MLP_FORWARD)]
LAYER_SIGNATURE = "    def forward(self, hidden_states, position_embeddings, attention_mask=None):\n"
ATTN_DECORATOR = "    @keep_signature\n    def forward(\n"


def replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def class_block(text: str, name: str) -> str:
    start = text.index(f"class {name}(")
    end = text.find("\n\n\nclass ", start)
    return text[start : end + 1]


def reindent(block: str, unit: str) -> str:
    return re.sub(r"^((?:    )+)", lambda m: unit * (len(m.group(1)) // 4), block, flags=re.MULTILINE)


def mlp_forward(body: str) -> str:
    """The fixture with TinyMLP.forward replaced by ``body`` (already indented)."""
    return replace_once(FIXTURE, MLP_FORWARD, body)


TAGGED = '''

def tagged(*names, **options):
    """A decorator factory with arguments, standing in for transformers' can_return_tuple & co."""

    def wrap(function):
        function.tags = (names, options)
        return function

    return wrap
'''

VARIANTS = {
    "tabs": reindent(FIXTURE, "\t"),
    "crlf": FIXTURE.replace("\n", "\r\n"),
    "cr": FIXTURE.replace("\n", "\r"),
    "bom_crlf": "\ufeff" + FIXTURE.replace("\n", "\r\n"),
    "bom_no_final_newline": "\ufeff" + FIXTURE.rstrip("\n"),
    "shebang_coding": "#!/usr/bin/env python3\n# -*- coding: utf-8 -*-\n" + FIXTURE,
    "form_feeds": replace_once(
        FIXTURE.replace("\n\n\nclass ", "\n\n\x0c\nclass "), "\n\n" + MLP_FORWARD, "\n\x0c\n" + MLP_FORWARD
    ),
    "mixed_indentation": FIXTURE.replace(
        class_block(FIXTURE, "TinyMLP"), reindent(class_block(FIXTURE, "TinyMLP"), "\t")
    ).replace(class_block(FIXTURE, "TinyDecoderLayer"), reindent(class_block(FIXTURE, "TinyDecoderLayer"), "  ")),
    "decorators": replace_once(
        replace_once(FIXTURE, "\n\nclass TinyRMSNorm", TAGGED + "\n\nclass TinyRMSNorm"),
        ATTN_DECORATOR,
        '    @tagged("attention",\n            level=2)  # arguments over two lines\n'
        "    # a comment between the decorators\n    @keep_signature\n\n    # and one between decorator and def\n"
        "    def forward(\n",
    ).replace(MLP_FORWARD, '    @tagged("mlp")\n    @keep_signature\n' + MLP_FORWARD),
    "posonly_kwonly": mlp_forward(
        "    def forward(self, x, /, *, scale=1.0):\n"
        "        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) * scale\n"
    ),
    "parameter_named_outputs": mlp_forward(
        "    def forward(self, x, outputs=None, _hp_outputs=None):\n"
        "        outputs = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))\n"
        "        return outputs if _hp_outputs is None else _hp_outputs\n"
    ),
    "star_args": replace_once(
        FIXTURE,
        LAYER_SIGNATURE + "        residual = hidden_states\n",
        "    def forward(self, hidden_states, *args, attention_mask=None):\n"
        "        (position_embeddings,) = args\n        residual = hidden_states\n",
    ),
    "nested_function_returns": mlp_forward(
        "    def forward(self, x):\n"
        "        def gate(value):\n"
        "            if value is None:\n"
        "                return None\n"
        "            return F.silu(self.gate_proj(value))\n"
        "\n"
        "        lazy = lambda: self.up_proj(x)  # noqa: E731\n"
        "        return self.down_proj(gate(x) * lazy())\n"
    ),
    "try_finally": mlp_forward(
        "    def forward(self, x):\n"
        "        try:\n"
        "            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))\n"
        "        finally:\n"
        "            self.calls = getattr(self, 'calls', 0) + 1\n"
    ),
    "docstring_only_before_forward": replace_once(
        FIXTURE,
        MLP_INIT_AND_FORWARD,
        '    """Gated MLP: nothing but this docstring comes before forward."""\n'
        + MLP_FORWARD
        + "\n"
        + MLP_INIT_AND_FORWARD[: MLP_INIT_AND_FORWARD.index(MLP_FORWARD)].rstrip("\n")
        + "\n",
    ),
    "one_line_forward": mlp_forward(
        "    def forward(self, x): return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))\n"
    ),
    "semicolons_and_continuations": mlp_forward(
        "    def forward(self, \\\n                x):\n"
        "        gate = F.silu(self.gate_proj(x)); up = self.up_proj(x)\n"
        "        return \\\n            self.down_proj(gate * up)\n"
    ),
    "nested_classes": replace_once(
        replace_once(
            FIXTURE,
            "\n\nclass TinyAttention(",
            "\n\nclass Holder:\n    class TinyAttention(nn.Module):  # named like a boundary, nested\n"
            "        def forward(self, hidden_states):\n            return None\n\n\nclass TinyAttention(",
        ),
        MLP_FORWARD,
        "    class TinyMLP:  # a helper named like its owner\n"
        "        def forward(self):\n            return 'inner'\n\n" + MLP_FORWARD,
    ),
    "comments_everywhere": replace_once(
        FIXTURE, MLP_FORWARD, "    # before forward\n" + MLP_FORWARD + "        # after the body\n    # dedented comment\n"
    ),
}
# (plan, mode) pairs each variant is lowered under: per-contract subclasses, tp_collective
# and region forms, both modes (the generic form comes from the *args and try variants).
PLAN_RUNS = [(FIXTURES / "plan_tp_sp.json", "default"), (PLANS / "tiny_region.json", "toggle")]


def newline_of(text: str) -> str:
    return "\r\n" if "\r\n" in text else "\r" if "\r" in text else "\n"


INPUT_IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 11], [4, 4, 8, 0, 95, 6, 1]])


def logits(module: types.ModuleType, state: dict | None = None):
    torch.manual_seed(0)
    model = module.TinyForCausalLM(module.TinyConfig())
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        return model(INPUT_IDS), model.state_dict()


def lower_cli(*args) -> object:
    result = CliRunner().invoke(cli, ["lower", *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def check_classes(source: str, output: str) -> None:
    """Classes not rewritten are byte-identical; rewritten ones keep forward's body as _forward_impl."""
    before = cst.parse_module(source.removeprefix("\ufeff"))
    after = cst.parse_module(output.removeprefix("\ufeff"))
    code = before.code_for_node
    new = {s.name.value: s for s in after.body if isinstance(s, cst.ClassDef)}
    for node in (s for s in before.body if isinstance(s, cst.ClassDef)):
        body = node.body.body
        impls = [s for s in new[node.name.value].body.body if isinstance(s, cst.FunctionDef) and s.name.value == "_forward_impl"]
        if not impls:
            assert code(new[node.name.value]) == code(node)
            continue
        (forward,) = [s for s in body if isinstance(s, cst.FunctionDef) and s.name.value == "forward"]
        assert code(impls[0].body) == code(forward.body) and code(impls[0].params) == code(forward.params)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hostile_but_valid_sources_lower_and_run_like_the_original(variant, tmp_path):
    """Each variant: exit 0, output compiles with the source's newline, BOM and final newline,
    other classes byte-identical, relowering refused, and the same logits as the variant."""
    text = VARIANTS[variant]
    source = tmp_path / "modeling_variant.py"
    source.write_bytes(text.encode("utf-8"))
    expected, state = logits(load_module(text))
    newline = newline_of(text)
    for number, (plan, mode) in enumerate(PLAN_RUNS):
        out = tmp_path / f"out{number}.py"
        result = lower_cli(source, plan, "-o", out, "--mode", mode)
        assert result.exit_code == 0, result.stderr
        data = out.read_bytes()
        output = data.decode("utf-8")
        assert output.startswith("\ufeff") == text.startswith("\ufeff") and output.count("\ufeff") == text.count("\ufeff")
        breaks = re.findall(r"\r\n|\r|\n", output)
        assert set(breaks) == {newline}, f"{variant}: line breaks {set(breaks)} in a file using {newline!r}"
        assert output.endswith(newline) == text.endswith(newline)
        if text.startswith("#!"):
            assert output.startswith("#!/usr/bin/env python3\n# -*- coding: utf-8 -*-\n# Generated by hpgen")
        compile(output.removeprefix("\ufeff"), str(out), "exec", dont_inherit=True)
        check_classes(text, output)
        got, _ = logits(load_module(output), state)
        assert torch.equal(got, expected), f"{variant} under {plan.name}: the generated file computes otherwise"
    again = lower_cli(out, plan, "-o", tmp_path / "again.py")
    assert again.exit_code == 2 and "this file was generated by hpgen" in again.stderr
    assert not (tmp_path / "again.py").exists()


def test_variants_really_exercise_what_they_name():
    """Guards the variants above: each differs from the fixture and still parses as Python."""
    for name, text in VARIANTS.items():
        assert text != FIXTURE, name
        compile(text.removeprefix("\ufeff"), name, "exec", dont_inherit=True)
    assert "\t\tdef forward" not in VARIANTS["mixed_indentation"] and "\tdef forward(self, x):" in VARIANTS["mixed_indentation"]
    assert "  def forward(self, hidden_states, position_embeddings" in VARIANTS["mixed_indentation"]


def test_mixed_indentation_keeps_each_class_in_its_own_indent(tmp_path):
    """A tab-indented class in a space-indented file gets a forward indented with tabs only,
    and a two-space class gets two-space blocks, subclasses included."""
    source = tmp_path / "modeling.py"
    source.write_text(VARIANTS["mixed_indentation"])
    for mode in ("default", "toggle"):
        result = lower_cli(source, FIXTURES / "plan_tp_sp.json", "--mode", mode)
        assert result.exit_code == 0, result.stderr
        mlp = class_block(result.stdout, "TinyMLP")
        assert all(not line.startswith(" ") for line in mlp.splitlines()[1:]), mlp
        assert "\tdef forward(self, x):\n\t\t# hpgen tp_collective" in mlp
        layer = result.stdout[result.stdout.index("class TinyDecoderLayer(") : result.stdout.index("class TinyModel(")]
        assert "class TinyDecoderLayer_hp1(TinyDecoderLayer):\n" in layer
        for line in layer.splitlines()[1:]:
            indent = line[: len(line) - len(line.lstrip())]
            assert set(indent) <= {" "} and len(indent) % 2 == 0, repr(line)
        if mode == "toggle":
            assert "\n    if self.tp_enable:\n      # hidden_states: tp R -> S(1) ==> split(dim=1)\n" in layer


def test_a_one_line_forward_in_a_tab_indented_class_gets_a_tab_indented_forward(tmp_path):
    """With no body block to read the indent from, the new forward follows its class."""
    block = class_block(VARIANTS["one_line_forward"], "TinyMLP")
    source = tmp_path / "modeling.py"
    source.write_text(VARIANTS["one_line_forward"].replace(block, reindent(block, "\t")))
    result = lower_cli(source, FIXTURES / "plan_tp.json", "--mode", "toggle")
    assert result.exit_code == 0, result.stderr
    mlp = class_block(result.stdout, "TinyMLP")
    assert "\tdef _forward_impl(self, x): return self.down_proj(" in mlp
    assert "\tdef forward(self, x):\n\t\t# hpgen tp_collective (toggle)" in mlp
    assert "\n\t\tif self.tp_enable:\n\t\t\t# output: tp P(sum) -> R" in mlp
    assert all(not line.startswith(" ") for line in mlp.splitlines()[1:]), mlp


def test_only_the_forwards_own_returns_decide_the_form(tmp_path):
    """A nested function's ``return None`` is not the forward's: TinyMLP stays tp_collective."""
    source = tmp_path / "modeling.py"
    source.write_text(VARIANTS["nested_function_returns"])
    result = lower_cli(source, FIXTURES / "plan_tp.json")
    mlp = class_block(result.stdout, "TinyMLP")
    assert '_hp_boundary_form = "tp_collective"' in mlp


def test_a_parameter_named_outputs_gets_a_fresh_result_name(tmp_path):
    """The generated local must not clash with forward's own ``outputs`` / ``_hp_outputs``."""
    source = tmp_path / "modeling.py"
    source.write_text(VARIANTS["parameter_named_outputs"])
    result = lower_cli(source, FIXTURES / "plan_tp.json")
    mlp = class_block(result.stdout, "TinyMLP")
    assert "_hp_outputs_2 = self._forward_impl(x, outputs, _hp_outputs)\n" in mlp
    assert "return _hp_outputs_2\n" in mlp


# --------------------------------------------------------------------------- refused sources


def _source_with(old: str, new: str) -> str:
    return replace_once(FIXTURE, old, new)


def line_of(text: str, needle: str) -> int:
    return text[: text.index(needle)].count("\n") + 1


MLP_LINE = line_of(FIXTURE, MLP_FORWARD)
REFUSED = {
    "forward is a lambda": (
        _source_with(MLP_FORWARD, "    forward = lambda self, x: self.down_proj(x)\n"),
        f"{MLP_LINE}:1: TinyMLP.forward is not a def statement",
    ),
    "forward wrapped after its def": (
        _source_with(MLP_FORWARD, MLP_FORWARD + "\n    forward = torch.no_grad()(forward)\n"),
        f"{MLP_LINE + 3}:1: class TinyMLP defines forward more than once (lines {MLP_LINE}, {MLP_LINE + 3})",
    ),
    "forward is a staticmethod": (
        _source_with(MLP_FORWARD, "    @staticmethod\n    def forward(x):\n        return x\n"),
        f"{MLP_LINE + 1}:1: TinyMLP.forward is a staticmethod",
    ),
    "forward is a classmethod": (
        _source_with(MLP_FORWARD, "    @classmethod\n    def forward(cls, x):\n        return x\n"),
        f"{MLP_LINE + 1}:1: TinyMLP.forward is a classmethod",
    ),
    "forward takes no self": (
        _source_with(MLP_FORWARD, "    def forward(*inputs):\n        return inputs[1]\n"),
        f"{MLP_LINE}:1: TinyMLP.forward takes no self parameter",
    ),
    "boundary class defined twice": (
        _source_with("\n\nclass TinyDecoderLayer(", "\n\nclass TinyMLP(nn.Module):\n    pass\n\n\nclass TinyDecoderLayer("),
        f"class TinyMLP is defined more than once (lines {line_of(FIXTURE, 'class TinyMLP(')}, ",
    ),
    "class already has _forward_impl": (
        _source_with(MLP_FORWARD, "    def _forward_impl(self, x):\n        return x\n\n" + MLP_FORWARD),
        f"{MLP_LINE}:1: class TinyMLP already defines _forward_impl, a name hpgen generates",
    ),
    "base class already has _forward_impl": (
        _source_with(
            "class TinyMLP(nn.Module):", "class MlpBase(nn.Module):\n    _forward_impl = None\n\n\nclass TinyMLP(MlpBase):"
        ),
        f"{line_of(FIXTURE, 'class TinyMLP(') + 1}:1: MlpBase, a base of TinyMLP, already defines _forward_impl",
    ),
    "class already has an _hp_ attribute": (
        _source_with(MLP_FORWARD, "    _hp_tp = None\n\n" + MLP_FORWARD),
        f"{MLP_LINE}:1: class TinyMLP already defines _hp_tp",
    ),
    "boundary class only nested in another class": (
        FIXTURE.replace(
            class_block(FIXTURE, "TinyMLP"), "class Holder:\n" + textwrap.indent(class_block(FIXTURE, "TinyMLP"), "    ")
        ),
        "its class TinyMLP is not defined in",
    ),
    "NUL byte": (
        _source_with("        return self.down_proj(F", "        return self.down_proj(\0F"),
        f"{MLP_LINE + 1}:31: source does not parse",
    ),
    "tabs and spaces mixed in one block": (
        _source_with(MLP_FORWARD, "    def forward(self, x):\n\tif x is None:\n\t    return x\n        return x\n"),
        f"{MLP_LINE + 1}:",
    ),
    "unexpected indent": (_source_with(MLP_FORWARD, MLP_FORWARD + "          x = 1\n"), f"{MLP_LINE + 2}:"),
    "unterminated triple quote": (
        _source_with(MLP_FORWARD, "    '''never closed\n" + MLP_FORWARD),
        f"{MLP_LINE}:5: source does not parse: unterminated triple-quoted string",
    ),
    # CPython resets the indentation count at a form feed: this def is a module-level function.
    "form feed inside indentation": (
        _source_with(MLP_FORWARD, "    \x0c" + MLP_FORWARD[4:]),
        f"{line_of(FIXTURE, 'class TinyMLP(')}:1: class TinyMLP has no forward of its own",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_sources_hpgen_cannot_rewrite_exit_2_naming_the_line(case, tmp_path):
    """Exit 2, one ``error:`` line that names the source line (or the plan place), nothing written."""
    text, expected = REFUSED[case]
    source, out = tmp_path / "modeling.py", tmp_path / "out.py"
    source.write_bytes(text.encode("utf-8"))
    result = lower_cli(source, FIXTURES / "plan_tp.json", "-o", out)
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1, repr(result.stderr)
    assert expected in result.stderr, result.stderr
    if "not defined in" not in expected:
        assert result.stderr.startswith(f"error: {source}:")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["modeling.py"]


def test_a_toggle_flag_the_class_already_has_is_refused_in_toggle_mode_only(tmp_path):
    """``tp_enable`` is generated in toggle mode only: a class that has one lowers in default mode."""
    source = tmp_path / "modeling.py"
    source.write_text(_source_with(MLP_FORWARD, "    tp_enable = True\n\n" + MLP_FORWARD))
    toggle = lower_cli(source, FIXTURES / "plan_tp.json", "--mode", "toggle")
    assert toggle.exit_code == 2
    assert f"{source}:{MLP_LINE}:1: class TinyMLP already defines tp_enable, which --mode toggle generates" in toggle.stderr
    assert lower_cli(source, FIXTURES / "plan_tp.json").exit_code == 0


@pytest.mark.parametrize(
    ("name", "what"), [("self", "the module itself"), ("kwargs", "the var_keyword parameter")]
)
def test_a_plan_input_naming_self_or_kwargs_is_refused(name, what, tmp_path):
    """``self = all_gather(self)`` or ``kwargs = all_gather(kwargs)`` would be nonsense code."""
    plan = json.loads((FIXTURES / "plan_tp.json").read_text())
    plan["param_plan"]["model.layers.*.self_attn"]["in_src"] = {name: {"tp": "S(1)"}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    result = lower_cli(FIXTURES / "modeling_tiny.py", path)
    assert result.exit_code == 2
    assert f'param_plan["model.layers.*.self_attn"].in_src.{name}: {name!r} is {what} of TinyAttention.forward' in result.stderr
