"""Targets: what to generate, from the command line or ``[tool.hpgen]`` in pyproject.toml.

``pyproject.toml`` is found by walking up from the current directory, as ruff and
black do; target paths are relative to it::

    [tool.hpgen]
    targets = [
      { source = "src/modeling_llama.py", plan = "plans/tp.json", output = "gen/modeling_llama_tp.py" },
      { source = "src/modeling_llama.py", plan = "plans/tp.json", output = "gen/toggle.py", mode = "toggle" },
    ]

Everything here is checked before any target is lowered, and exits 2 naming the place: a
table that does not parse stops the run; a bad entry (an unknown key, a missing source or
plan) is reported in its turn while the other targets are still lowered.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from hpgen.core.errors import HpgenError
from hpgen.core.plan import is_dotted_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

MODES = ("default", "toggle")
_KEYS = {"source", "plan", "output", "mode", "package"}


@dataclass(frozen=True)
class Target:
    """One generated file: its inputs, its options, and where it was declared."""

    source: Path
    plan: Path
    output: Path | None  # None: standard output
    mode: str = "default"
    package: str | None = None
    origin: str = "command line"  # for messages: "pyproject.toml:tool.hpgen.targets[2]"

    @property
    def output_name(self) -> str:
        return "-" if self.output is None else str(self.output)


def find_pyproject(start: Path) -> Path | None:
    """The nearest pyproject.toml at or above ``start`` that has a [tool.hpgen] table."""
    for folder in (start.resolve(), *start.resolve().parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            try:
                if "hpgen" in _read_toml(candidate).get("tool", {}):
                    return candidate
            except HpgenError:
                return candidate  # let load_targets report the parse error
    return None


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise HpgenError(f"invalid TOML: {exc}", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HpgenError(f"cannot read: {exc}", file=str(path)) from None


@dataclass(frozen=True)
class BadTarget:
    """A ``[tool.hpgen]`` entry that cannot be lowered: reported in its turn, the others still run."""

    error: HpgenError
    output: Path | None  # where the entry names one, so that ``hpgen check OUTPUT`` finds it
    origin: str

    @property
    def output_name(self) -> str:
        return self.origin if self.output is None else str(self.output)


def load_targets(pyproject: Path) -> list[Target | BadTarget]:
    """The targets of ``[tool.hpgen]``, with paths made relative to the cwd.

    A table that does not parse or has no list of targets is an ``HpgenError``; an entry
    that is wrong (an unknown key, a missing source or plan, a bad mode) becomes a
    :class:`BadTarget` in its place, so that one bad target does not stop the others.
    """
    table = _read_toml(pyproject).get("tool", {}).get("hpgen")
    name = str(pyproject)
    if not isinstance(table, dict):
        raise HpgenError("no [tool.hpgen] table", file=name)
    unknown = sorted(set(table) - {"targets"})
    if unknown:
        raise HpgenError(f"unknown key {unknown[0]!r} (allowed: targets)", file=name, where=f"tool.hpgen.{unknown[0]}")
    entries = table.get("targets")
    if not isinstance(entries, list) or not entries:
        raise HpgenError("expected a non-empty list of targets", file=name, where="tool.hpgen.targets")
    targets: list[Target | BadTarget] = []
    outputs: dict[Path, str] = {}
    for number, entry in enumerate(entries):
        where = f"tool.hpgen.targets[{number}]"
        try:
            targets.append(_read_target(entry, pyproject, where, outputs))
        except HpgenError as error:
            output = entry.get("output") if isinstance(entry, dict) else None
            named = _relative(pyproject.parent / output) if isinstance(output, str) and output else None
            targets.append(BadTarget(error, named, f"{name}:{where}"))
    return targets


def _read_target(entry: object, pyproject: Path, where: str, outputs: dict[Path, str]) -> Target:
    """One entry of the list, checked; ``outputs`` (output -> entry) grows by its output."""
    name = str(pyproject)
    if not isinstance(entry, dict):
        raise HpgenError("expected a table with source, plan and output", file=name, where=where)
    for key in sorted(entry):
        if key not in _KEYS:
            raise HpgenError(f"unknown key {key!r} (allowed: {', '.join(sorted(_KEYS))})", file=name, where=f"{where}.{key}")
    paths = {}
    for key in ("source", "plan", "output"):
        value = entry.get(key)
        if not isinstance(value, str) or not value:
            raise HpgenError(f"{key!r} must be a path (a non-empty string)", file=name, where=f"{where}.{key}")
        paths[key] = _relative(pyproject.parent / value)
        if key != "output" and not paths[key].is_file():
            raise HpgenError(f"no such file: {value}", file=name, where=f"{where}.{key}")
    mode = entry.get("mode", "default")
    if mode not in MODES:
        raise HpgenError(f"mode {mode!r} is not one of {', '.join(MODES)}", file=name, where=f"{where}.mode")
    package = entry.get("package")
    if package is not None and not is_dotted_path(package):
        raise HpgenError(f"package {package!r} is not a dotted package name", file=name, where=f"{where}.package")
    output = paths["output"].resolve()
    if output in outputs:
        raise HpgenError(f"output {entry['output']!r} is also the output of {outputs[output]}", file=name, where=f"{where}.output")
    if output == paths["source"].resolve():
        raise HpgenError("the output would overwrite the source", file=name, where=f"{where}.output")
    outputs[output] = where
    return Target(paths["source"], paths["plan"], paths["output"], mode, package, f"{name}:{where}")


def _relative(path: Path) -> Path:
    """``path`` relative to the cwd, as ruff and black show paths in messages."""
    try:
        return Path(os.path.relpath(path.resolve(), Path.cwd().resolve()))
    except ValueError:  # another drive on Windows
        return path
