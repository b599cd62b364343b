"""The user documentation in docs/ stays true: real lowered excerpts, every plan key documented.

``docs/generated-code.md`` holds excerpts between ``<!-- excerpt: SOURCE PLAN MODE CLASS -->``
and ``<!-- end excerpt -->``: the named class as ``hpgen lower`` writes it today. This test
regenerates each one and fails with the difference when the page is stale; to update it,
run ``HPGEN_UPDATE_GOLDEN=1 python -m pytest tests/package/test_docs.py`` (as for the golden files).
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import symtable
from pathlib import Path

import pytest

from hpgen.generator.lower import lower
from hpgen.core.plan import load_plan
from hpgen.core.plan_reader import ENTRY_KEYS, INJECTION_KEYS, TOP_LEVEL_KEYS
from tests.support.doc_blocks import EXCERPT, python_blocks

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def _class_text(source: str, name: str) -> str:
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise AssertionError(f"no class {name} in the lowered file")


def _rendered(match: re.Match) -> str:
    opening, source, plan, mode, name = match.group(1, 2, 3, 4, 5)
    text = lower((REPO / source).read_text(), load_plan(REPO / plan), mode=mode, source_name=Path(source).name)
    return f"{opening}```python\n{_class_text(text, name)}\n```\n{match.group(7)}"


# only the pages that hold excerpts: a page with none would pass without checking anything
EXCERPT_PAGES = [page for page in sorted(DOCS.glob("*.md")) if EXCERPT.search(page.read_text())]


@pytest.mark.parametrize("page", EXCERPT_PAGES, ids=lambda path: path.name)
def test_excerpts_are_what_hpgen_writes(page: Path) -> None:
    text = page.read_text()
    fresh = EXCERPT.sub(_rendered, text)
    if fresh != text and os.environ.get("HPGEN_UPDATE_GOLDEN"):
        page.write_text(fresh)
        return
    assert fresh == text, f"{page.name} is stale: HPGEN_UPDATE_GOLDEN=1 python -m pytest tests/package/test_docs.py"


def test_the_generated_code_page_has_its_excerpts() -> None:
    assert [page.name for page in EXCERPT_PAGES] == ["generated-code.md"]
    assert len(EXCERPT.findall((DOCS / "generated-code.md").read_text())) == 3


def _documented_keys() -> set[str]:
    """The names in backticks in the first cell of each table row of the plan format page."""
    rows = [line for line in (DOCS / "plan-format.md").read_text().splitlines() if line.startswith("| ")]
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


@pytest.mark.parametrize("key", sorted(TOP_LEVEL_KEYS | ENTRY_KEYS | INJECTION_KEYS))
def test_every_plan_key_the_loader_accepts_is_documented(key: str) -> None:
    assert key in _documented_keys()


@pytest.mark.parametrize("placement", ["R", "S(d)", "P(op)", "SS(d,k)", "RS(d,r)"])
def test_every_placement_is_documented(placement: str) -> None:
    assert placement in _documented_keys()


def test_nothing_points_outside_the_repository() -> None:
    for path in [REPO / "README.md", *DOCS.glob("*.md"), *(REPO / "hpgen").rglob("*.py")]:
        assert "../shared" not in path.read_text(), path


# --------------------------------------------------------------------------- the Python blocks

PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def unbound_names(code: str, bound: set[str]) -> list[str]:
    """Names ``code`` reads that nothing binds: not the block, not ``bound``, not a builtin."""
    known = bound | set(dir(builtins))
    module = symtable.symtable(code, "<block>", "exec")
    defined = {symbol.get_name() for symbol in module.get_symbols() if symbol.is_assigned() or symbol.is_imported()}
    missing: set[str] = set()
    pending = [module]
    while pending:
        table = pending.pop()
        pending += table.get_children()
        for symbol in table.get_symbols():
            free = symbol.is_global() if table is not module else not (symbol.is_assigned() or symbol.is_imported())
            if symbol.is_referenced() and free and symbol.get_name() not in defined | known:
                missing.add(symbol.get_name())
    return sorted(missing)


def page_bindings(code: str) -> set[str]:
    """The names a block binds at its top level (imports, assignments, defs), for the blocks after it."""
    return {symbol.get_name() for symbol in symtable.symtable(code, "<block>", "exec").get_symbols()
            if symbol.is_assigned() or symbol.is_imported()}


# only the pages that hold Python blocks (excerpts aside): a page with none would pass without checking anything
BLOCK_PAGES = [page for page in PAGES if python_blocks(page.read_text())]


def test_the_walk_throughs_have_their_blocks_checked() -> None:
    assert {"README.md", "runtime.md", "checkpoints.md", "lora.md"} <= {page.name for page in BLOCK_PAGES}


@pytest.mark.parametrize("page", BLOCK_PAGES, ids=lambda path: path.name)
def test_every_python_block_is_complete(page: Path) -> None:
    """A reader can run each block as written: every name it uses is imported or defined in it, or in an
    earlier block of the same page (a page reads as one walk-through)."""
    bound: set[str] = set()
    for line, code in python_blocks(page.read_text()):
        compile(code, f"{page.name}:{line}", "exec")
        missing = unbound_names(code, bound)
        assert not missing, f"{page.name}:{line}: the block uses {', '.join(missing)}, which nothing defines or imports"
        bound |= page_bindings(code)


def test_the_block_check_finds_what_a_reader_would_miss() -> None:
    assert unbound_names("model = generated.LlamaForCausalLM(config)\nlogits = model(input_ids)\n", set()) == [
        "config", "generated", "input_ids"]
    assert unbound_names("import torch\ndef f(x):\n    return torch.relu(x) + y\n", set()) == ["y"]
    assert unbound_names("for layer in model.layers:\n    print([p for p in layer.parameters()])\n", {"model"}) == []
    excerpt = "<!-- excerpt: a b c D -->\n```python\nclass D(nn.Module): ...\n```\n<!-- end excerpt -->\n"
    assert python_blocks(excerpt + "```python\nx = 1\n```\n") == [(7, "x = 1\n")]


# ``from hpgen... import ...`` and ``import hpgen...`` as the pages and examples show them
# (one line, or a parenthesized list over several).
HPGEN_IMPORT = re.compile(r"^[ \t>]*((?:from hpgen[\w.]* import (?:\([^)]*\)|[^\n]+))|(?:import hpgen[\w.]*[^\n]*))", re.M)


def hpgen_imports(text: str) -> list[str]:
    """Each hpgen import statement of ``text``, with a trailing comment cut off."""
    return [" ".join(match.group(1).split("#")[0].split()) for match in HPGEN_IMPORT.finditer(text)]


IMPORT_SOURCES = [REPO / "README.md", *sorted(DOCS.glob("*.md")), *sorted((REPO / "examples").glob("*.py"))]
SHOWN_IMPORTS = sorted(
    {(path.relative_to(REPO).as_posix(), line) for path in IMPORT_SOURCES for line in hpgen_imports(path.read_text())}
)


def test_the_pages_show_hpgen_imports() -> None:
    """The check below has something to check: the pages name hpgen's user paths."""
    assert {line for _, line in SHOWN_IMPORTS} >= {"from hpgen.runtime import parallelize", "from hpgen.runtime.trainer import Trainer"}
    assert hpgen_imports("x\n    from hpgen.a import (\n  b,\n  c,\n)  # two\n>>> import hpgen.d  # ok\n") == [
        "from hpgen.a import ( b, c, )",
        "import hpgen.d",
    ]


@pytest.mark.parametrize(("where", "line"), SHOWN_IMPORTS, ids=[f"{where}: {line}" for where, line in SHOWN_IMPORTS])
def test_every_hpgen_import_the_pages_show_runs(where: str, line: str) -> None:
    """Each path a user copies from README, docs/ or examples/ imports (moved modules take their pages along)."""
    exec(compile(line, where, "exec"), {})
