"""Scale (issue 7): a ~20,000-line modeling file lowers correctly.

The synthetic file repeats the fixture's classes under new names (``Tiny0Attention``,
``Tiny1Attention``, ...) below one import block, and a root class holds every tenth
copy's model; the plan is the fixture's tensor- and sequence-parallel plan on each of
those copies. The test checks the result, not the time: the time is recorded as a test
property (``--junitxml``) and ``benchmarks/scale.py`` prints how it grows with size.
"""

from __future__ import annotations

import ast
import json
import re
import time

import torch

from hpgen.generator.lower import lower
from hpgen.core.plan import plan_from_dict

from tests.conftest import FIXTURES
from tests.support.modules import load_module

FIXTURE = (FIXTURES / "modeling_tiny.py").read_text()
_CUT = FIXTURE.index("@dataclass\nclass TinyConfig")
PRELUDE, BODY = FIXTURE[:_CUT], FIXTURE[_CUT:] + "\n\n"
LINES_PER_COPY = BODY.count("\n")
TP_SP = json.loads((FIXTURES / "plan_tp_sp.json").read_text())
ROOT = "SyntheticForCausalLM"


def synthetic_modeling_file(lines: int, every: int = 10) -> tuple[str, dict, list[int]]:
    """(source of about ``lines`` lines, plan document, numbers of the planned copies)."""
    copies = max(1, round((lines - PRELUDE.count("\n")) / LINES_PER_COPY))
    planned = list(range(0, copies, every))
    root = (
        f"class {ROOT}(nn.Module):\n    def __init__(self, config):\n        super().__init__()\n"
        + "".join(f"        self.m{k} = Tiny{k}ForCausalLM(config)\n" for k in planned)
    )
    text = PRELUDE + "".join(BODY.replace("Tiny", f"Tiny{k}") for k in range(copies)) + root
    plan = {
        "mesh_dim_names": ["tp"],
        "model_class": ROOT,
        "param_plan": {f"m{k}.{key}": entry for k in planned for key, entry in TP_SP["param_plan"].items()},
    }
    return text, plan, planned


def class_texts(text: str) -> dict[str, tuple[str, ast.ClassDef]]:
    """Top-level class name -> (its exact text, its node), from line ranges of the ast."""
    lines = text.splitlines(keepends=True)
    return {
        node.name: ("".join(lines[node.lineno - 1 : node.end_lineno]), node)
        for node in ast.parse(text).body
        if isinstance(node, ast.ClassDef)
    }


def body_text(text_lines: list[str], function: ast.FunctionDef) -> str:
    return "".join(text_lines[function.body[0].lineno - 1 : function.body[-1].end_lineno])


def method(node: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == name), None)


def test_a_20000_line_file_lowers_correctly(record_property):
    """~20k lines, 120 copies of the fixture, 12 planned: exactly the planned boundary classes are
    rewritten (bodies kept byte for byte), every other class is byte-identical, and the
    generated models compute what the original ones do."""
    text, plan, planned = synthetic_modeling_file(20_000)
    assert 19_000 <= text.count("\n") <= 21_000 and len(planned) >= 10
    start = time.perf_counter()
    output = lower(text, plan_from_dict(plan, name="plan.json"), source_name="modeling_synthetic.py")
    record_property("lower_seconds", round(time.perf_counter() - start, 3))
    record_property("source_lines", text.count("\n"))

    before, after = class_texts(text), class_texts(output)
    source_lines, output_lines = text.splitlines(keepends=True), output.splitlines(keepends=True)
    rewritten = {f"Tiny{k}{suffix}" for k in planned for suffix in ("Attention", "MLP", "DecoderLayer")}
    subclasses = {f"Tiny{k}DecoderLayer_hp1" for k in planned}
    assert set(after) == set(before) | subclasses
    assert [name for name in after if name in before] == list(before)
    for name, (segment, node) in before.items():
        if name not in rewritten:
            assert after[name][0] == segment, f"{name} changed"
            continue
        new = after[name][1]
        impl, forward = method(new, "_forward_impl"), method(node, "forward")
        assert impl is not None and method(new, "forward") is not None, name
        assert body_text(output_lines, impl) == body_text(source_lines, forward), name
    assert output.count("    def _forward_impl(") == len(rewritten)

    original, generated = load_module(text, "_scale_original"), load_module(output, "_scale_generated")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    for k in (planned[-1], planned[-1] + 1):  # a planned copy and one that is not
        config = getattr(original, f"Tiny{k}Config")()
        torch.manual_seed(k)
        reference = getattr(original, f"Tiny{k}ForCausalLM")(config)
        model = getattr(generated, f"Tiny{k}ForCausalLM")(config)
        model.load_state_dict(reference.state_dict())
        with torch.no_grad():
            assert torch.equal(model(ids), reference(ids))
    assert re.search(rf"class Tiny{planned[-1]}MLP\(nn\.Module\):\n    _hp_boundary_form = \"tp_collective\"", output)
