"""The layers of hpgen hold: no module imports one of a layer it may not use, and no import cycle.

Every import of every hpgen module counts, at module level or inside a function (an import
inside a function is still a dependency; it only hides a cycle). For the layers, imports
under ``if TYPE_CHECKING:`` are for annotations only and do not run, so they do not count;
for cycles they do (:func:`test_no_import_cycle_even_through_annotations`). The layers are
those of the ``hpgen`` package docstring and docs/architecture.md.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import hpgen

PACKAGE = Path(hpgen.__file__).parent

# The layers that are packages under hpgen/, by the package's name.
PACKAGES = {"core": "core", "generator": "generator", "runtime": "runtime", "planner": "planner", "verify": "verify"}

# What each layer may import (itself included).
ALLOWED = {
    "core": {"core"},
    "generator": {"core", "generator"},
    "runtime": {"core", "runtime"},
    "planner": {"core", "generator", "planner"},
    "verify": {"core", "generator", "runtime", "planner", "verify"},
    "cli": {"core", "generator", "runtime", "planner", "verify", "cli"},
}

def module_name(path: Path) -> str:
    parts = ["hpgen", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "core"  # the package itself: its docstring and __version__
    if parts[1] in PACKAGES:
        return PACKAGES[parts[1]]
    if parts[1] in ("cli", "__main__"):
        return "cli"
    raise AssertionError(f"{module} is in no layer: add it to one in tests/package/test_layers.py and the docs")


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skipped


def imports(module: str, *, annotations: bool = False) -> set[str]:
    """The hpgen modules ``module`` imports, resolved to modules that exist (``annotations``: those
    under ``if TYPE_CHECKING:`` too)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    skipped = set() if annotations else _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            # ``from hpgen.x import y``: y may be a module of package x
            targets = [f"{stem}.{alias.name}" for alias in node.names if f"{stem}.{alias.name}" in MODULES]
            targets.append(stem)
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("hpgen") and target != module:
                found.add(target)
    return found


GRAPH = {module: imports(module) for module in MODULES}
EVERY_IMPORT = {module: imports(module, annotations=True) for module in MODULES}


def test_every_import_runs_down_the_layers():
    wrong = sorted(
        f"{module} ({layer(module)}) imports {target} ({layer(target)})"
        for module, targets in GRAPH.items()
        for target in targets
        if layer(target) not in ALLOWED[layer(module)]
    )
    assert not wrong, "\n".join(wrong)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest import cycle inside ``component`` through its first module: ``[a, b, ..., a]``."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{sorted(component)} is no cycle")


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each cycle of ``graph`` as ``a -> b -> a``, with all the modules of its strongly connected component."""
    found = []
    for component in _strongly_connected(graph):
        found.append(f"{' -> '.join(_shortest_cycle(graph, component))} (modules: {', '.join(sorted(component))})")
    return found


def test_no_import_cycle_even_through_annotations():
    """No hpgen module reaches itself through its imports, counting every kind: at module level,
    inside functions, and under ``if TYPE_CHECKING:`` (an import for annotations only does not
    run, but it still means neither module can be read, moved or tested without the other).
    """
    cycles = _cycles(EVERY_IMPORT)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# One name that two layers share for one meaning: the exception type of bad input
# (hpgen.core.errors.HpgenError) and of a model, plan and mesh that do not fit
# (hpgen.runtime.errors.ParallelizeError, which users catch by that path).
SHARED_NAMES = {"errors"}


def _shared_names(modules: Iterable[str]) -> dict[str, list[str]]:
    """File names (modules and packages) that more than one place in the package uses."""
    by_name: dict[str, list[str]] = {}
    for module in modules:
        if module != "hpgen":
            by_name.setdefault(module.rpartition(".")[2], []).append(module)
    return {name: sorted(found) for name, found in by_name.items() if len(found) > 1}


def test_each_file_name_has_one_meaning():
    """No two modules (or packages) of hpgen share a name, so a name says which one is meant."""
    shared = {name: found for name, found in _shared_names(MODULES).items() if name not in SHARED_NAMES}
    assert not shared, shared


def test_the_checks_can_fail():
    assert _shared_names(["hpgen.a.report", "hpgen.b.report", "hpgen.c"]) == {"report": ["hpgen.a.report", "hpgen.b.report"]}
    assert _strongly_connected({"a": {"b"}, "b": {"a"}, "c": set()}) == [{"a", "b"}]
    loop = {"x.a": {"x.b"}, "x.b": {"x.c", "x.a"}, "x.c": {"x.a"}, "x.d": set()}
    assert _cycles(loop) == ["x.a -> x.b -> x.a (modules: x.a, x.b, x.c)"]
    assert layer("hpgen.runtime.forward.collectives") == "runtime" and "planner" not in ALLOWED["runtime"]


RUNTIME = PACKAGE / "runtime"


def _runtime_groups() -> dict[str, set[str]]:
    """The runtime's groups as the tree has them: the package itself and each subpackage, with their modules."""
    groups = {"hpgen.runtime": {path.stem for path in RUNTIME.glob("*.py") if path.stem != "__init__"}}
    for init in sorted(RUNTIME.glob("*/__init__.py")):
        package = init.parent
        assert not list(package.glob("*/__init__.py")), f"{package} nests a package the runtime's map cannot name"
        groups[f"hpgen.runtime.{package.name}"] = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    return groups


def _docstring_groups() -> list[tuple[str, list[str]]]:
    """(package, modules) per bullet of the map in ``hpgen/runtime/__init__.py``: ``- ``pkg`` (role): ``m``, ...;``."""
    text = (ast.get_docstring(ast.parse((RUNTIME / "__init__.py").read_text())) or "").split("Module map", 1)[1]
    block = text[text.index("\n- ") :].split("\n\n", 1)[0]  # the list ends at the first blank line
    bullets = [" ".join(b.split()) for b in re.split(r"\n- ", block)[1:]]
    found = []
    for bullet in bullets:
        match = re.match(r"``([\w.]+)`` \((.*?)\): (.*)", bullet)
        assert match, f"a bullet of the runtime's map is not ``package`` (role): ``module``, ...: {bullet!r}"
        found.append((match.group(1), re.findall(r"``(\w+)``", match.group(3))))
    return found


def _page_groups() -> list[tuple[str, list[str]]]:
    """(package, modules) per row of docs/runtime.md's module map table."""
    page = (PACKAGE.parent / "docs" / "runtime.md").read_text().split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in page.splitlines() if line.startswith("| `")]
    return [(package.strip().strip("`"), re.findall(r"`(\w+)`", modules)) for package, _, modules in rows]


# The runtime's top level: what something outside hpgen names by path, so it stays where it is.
NAMED_FROM_OUTSIDE = {
    "defaults": "generated files import it",
    "context_logits": "users call its shard_logits (docs/context-parallel.md)",
    "errors": "users catch its ParallelizeError",
    "shard_layout": "torch.save of a state dict holding an SS parameter records its PackedShard",
    "trainer": "users train with its Trainer (docs/training.md)",
}


def test_the_runtime_keeps_at_its_top_level_what_outside_names_and_only_that():
    assert _runtime_groups()["hpgen.runtime"] == set(NAMED_FROM_OUTSIDE)


def test_what_generated_forwards_run_imports_no_install_or_checkpoint_code():
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module.startswith("hpgen.runtime.forward")
        for target in targets
        if target.startswith(("hpgen.runtime.install", "hpgen.runtime.checkpoint"))
    )
    assert not wrong, wrong


def test_checkpoint_code_imports_no_install_code():
    """``install`` imports ``checkpoint`` (state-dict hooks, reading a checkpoint into the shards), never the reverse."""
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in EVERY_IMPORT.items()
        if module.startswith("hpgen.runtime.checkpoint")
        for target in targets
        if target.startswith("hpgen.runtime.install")
    )
    assert not wrong, wrong


def test_the_runtime_maps_put_every_module_in_exactly_one_group():
    """The package docstring's map and docs/runtime.md's table name each group as the tree has it, and each module once."""
    groups = _runtime_groups()
    assert set(groups) == {
        "hpgen.runtime",
        "hpgen.runtime.install",
        "hpgen.runtime.forward",
        "hpgen.runtime.context",
        "hpgen.runtime.checkpoint",
        "hpgen.runtime.training",
        "hpgen.runtime.pipeline",
    }
    for where, listed in (("hpgen/runtime/__init__.py", _docstring_groups()), ("docs/runtime.md", _page_groups())):
        names = [name for _, modules in listed for name in modules]
        assert len(names) == len(set(names)), (where, sorted({n for n in names if names.count(n) > 1}))
        assert [package for package, _ in listed] == list(dict.fromkeys(p for p, _ in listed)), where
        assert {package: set(modules) for package, modules in listed} == groups, where


def test_each_runtime_group_names_its_modules():
    """Each subpackage's docstring says what every one of its modules does, and names no other."""
    groups = _runtime_groups()
    # the package's own docstring is the map, checked above; hpgen.runtime.context's is one fixed line
    # while issue 45's branches each add modules to it (the map above and docs/runtime.md name them)
    for package in set(groups) - {"hpgen.runtime", "hpgen.runtime.context"}:
        docstring = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
        listed = set(re.findall(rf"{re.escape(package)}\.([a-z_]+)", docstring))
        assert listed == groups[package], (package, sorted(listed ^ groups[package]))


PLANNER = PACKAGE / "planner"


def _planner_groups() -> dict[str, set[str]]:
    """The planner's subpackages as the tree has them, each with its modules (the package itself holds none)."""
    groups = {}
    for init in sorted(PLANNER.rglob("__init__.py")):
        package = module_name(init)
        groups[package] = {path.stem for path in init.parent.glob("*.py") if path.stem != "__init__"}
    return groups


def _planner_map() -> list[tuple[str, list[str]]]:
    """(package, modules) per bullet of the map in ``hpgen/planner/__init__.py``: ``- ``pkg`` (role): ``m``, ...;``."""
    text = (ast.get_docstring(ast.parse((PLANNER / "__init__.py").read_text())) or "").split("Module map", 1)[1]
    block = text[text.index("\n- ") :].split("\n\n", 1)[0]
    found = []
    for bullet in (" ".join(b.split()) for b in re.split(r"\n- ", block)[1:]):
        match = re.match(r"``([\w.]+)`` \((.*?)\): (.*)", bullet)
        assert match, f"a bullet of the planner's map is not ``package`` (role): ``module``, ...: {bullet!r}"
        found.append((match.group(1), re.findall(r"``(\w+)``", match.group(3))))
    return found


def test_the_planner_map_puts_every_module_in_exactly_one_subpackage():
    """The package docstring's map names each subpackage as the tree has it, and each of its modules once."""
    groups = _planner_groups()
    assert groups.pop("hpgen.planner") == set(), "the planner's modules live in its subpackages"
    listed = _planner_map()
    for package, modules in listed:
        assert len(modules) == len(set(modules)), (package, modules)
    assert len({p for p, _ in listed}) == len(listed)
    assert {package: set(modules) for package, modules in listed} == groups


def test_each_planner_subpackage_names_its_modules():
    """Each subpackage's docstring names every one of its modules, and no other."""
    for package, modules in _planner_groups().items():
        if package == "hpgen.planner":
            continue
        docstring = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
        listed = set(re.findall(rf"{re.escape(package)}\.([a-z_]+)", docstring)) - {
            name for name in _planner_groups() if name.startswith(package + ".")  # a nested subpackage, mentioned
        } - {name.rpartition(".")[2] for name in _planner_groups() if name.startswith(package + ".")}
        assert listed == modules, (package, sorted(listed ^ modules))


# The planner's subpackages from the bottom up: each imports only itself and those before it.
PLANNER_ORDER = (
    "hpgen.planner.model",
    "hpgen.planner.flow",
    "hpgen.planner.derive",
    "hpgen.planner.translate",
    "hpgen.planner.passes",
    "hpgen.planner.entry",
)


def _planner_rank(module: str) -> int:
    return next(i for i, package in enumerate(PLANNER_ORDER) if module == package or module.startswith(package + "."))


def test_the_planner_subpackages_import_only_those_below_them():
    """The map lists the subpackages in this order, and no module imports one of a subpackage after its own."""
    listed = [package for package, _ in _planner_map()]
    assert set(PLANNER_ORDER) <= set(listed)
    assert [_planner_rank(p) for p in listed] == sorted(_planner_rank(p) for p in listed)
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module.startswith("hpgen.planner.")
        for target in targets
        if target.startswith("hpgen.planner.") and _planner_rank(target) > _planner_rank(module)
    )
    assert not wrong, wrong


# The package's size, as the tree has it: hpgen/'s top level holds only the cli beside the
# layers' packages, and no module grows past what one reader takes in.
TOP_LEVEL_MODULES = 10
# The runtime keeps at most 5 modules at its top level (NAMED_FROM_OUTSIDE); the rest live
# in its role packages. Plans name the local compute functions by module names resolved
# through hpgen.core.plan_targets, so they need no module at the top level.
RUNTIME_TOP_LEVEL_MODULES = 5
MODULE_LINES = 600


def _top_level_modules(folder: Path) -> set[str]:
    """The modules directly in ``folder`` (``__init__``, the package itself, not counted)."""
    return {path.stem for path in folder.glob("*.py") if path.stem != "__init__"}


def test_hpgen_keeps_few_modules_at_its_top_level():
    found = _top_level_modules(PACKAGE)
    assert len(found) <= TOP_LEVEL_MODULES, f"{len(found)} modules at hpgen/'s top level: {sorted(found)}"


def test_the_runtime_top_level_does_not_grow():
    found = _top_level_modules(RUNTIME)
    assert len(found) <= RUNTIME_TOP_LEVEL_MODULES, f"{len(found)} modules at hpgen/runtime/'s top level: {sorted(found)}"


def _long_modules(paths: Iterable[Path], limit: int) -> list[str]:
    """``path: N lines`` for each of ``paths`` longer than ``limit`` lines."""
    found = []
    for path in paths:
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{path}: {lines} lines")
    return found


def test_no_module_is_over_600_lines():
    long = _long_modules(MODULES.values(), MODULE_LINES)
    assert not long, f"modules over {MODULE_LINES} lines (split them by what they do):\n" + "\n".join(long)


def test_the_size_checks_can_fail(tmp_path: Path):
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("x = 1\n" * 3)
    (tmp_path / "b.py").write_text("x = 1\n")
    assert _top_level_modules(tmp_path) == {"a", "b"}
    assert _long_modules(sorted(tmp_path.glob("*.py")), 2) == [f"{tmp_path / 'a.py'}: 3 lines"]


def _package_modules(package: str) -> set[str]:
    """The modules directly in ``package`` (a dotted name), from the tree."""
    folder = PACKAGE.parent.joinpath(*package.split("."))
    return _top_level_modules(folder)


def _subpackages(package: str) -> set[str]:
    folder = PACKAGE.parent.joinpath(*package.split("."))
    return {init.parent.name for init in folder.glob("*/__init__.py")}


def test_the_core_and_the_generator_name_their_modules():
    """``hpgen.core``'s and ``hpgen.generator``'s docstrings say what every one of their modules does, and name no other."""
    for package in ("hpgen.core", "hpgen.generator"):
        docstring = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
        listed = set(re.findall(rf"{re.escape(package)}\.(\w+)", docstring))
        assert listed == _package_modules(package), (package, sorted(listed ^ _package_modules(package)))


def _architecture_rows() -> dict[str, set[str]]:
    """package -> the names in backticks of its row's last cell, in docs/architecture.md's package map."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text().split("## Package map", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in page.splitlines() if line.startswith("| `")]
    return {package.strip().strip("`"): set(re.findall(r"`(\w+)`", modules)) for package, _, modules in rows}


def test_the_architecture_page_maps_every_package():
    """The page's package map has a row per top-level package and the top level, each naming what the tree holds:
    the modules of ``hpgen``, ``hpgen.core``, ``hpgen.generator`` and ``hpgen.verify``, and the subpackages of
    ``hpgen.runtime`` and ``hpgen.planner`` (whose modules runtime.md and the planner's table map)."""
    rows = _architecture_rows()
    assert set(rows) == {"hpgen", *(f"hpgen.{name}" for name in _subpackages("hpgen"))}
    for package in ("hpgen", "hpgen.core", "hpgen.generator", "hpgen.verify"):
        assert rows[package] == _package_modules(package), (package, sorted(rows[package] ^ _package_modules(package)))
    for package in ("hpgen.runtime", "hpgen.planner"):
        nested = {name for sub in _subpackages(package) for name in _subpackages(f"{package}.{sub}")}
        assert _subpackages(package) <= rows[package] <= _subpackages(package) | nested, package
