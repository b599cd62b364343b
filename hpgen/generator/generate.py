"""One target end to end: read its inputs, lower them, and tell whether its output is fresh.

The lowering machinery (libcst, jinja2) is imported only when a target is really
lowered, so ``hpgen check`` on fresh targets answers from the header's hashes alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from hpgen import __version__
from hpgen.core.errors import HpgenError
from hpgen.core.header import body_is_intact, display_name, read_header
from hpgen.generator.targets import Target


def read_source(path: Path) -> tuple[str, bytes]:
    """The source text (UTF-8, a BOM kept as U+FEFF, line endings untouched) and its bytes."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise HpgenError(f"cannot read source: {exc.strerror or exc}", file=str(path)) from None
    try:
        return data.decode("utf-8"), data
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise HpgenError("source is not UTF-8 text", file=str(path), where=f"{line}:1") from None


def read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise HpgenError(f"cannot read {what}: {exc.strerror or exc}", file=str(path)) from None


def infer_package(source: Path) -> str | None:
    """The package of ``source`` from its ``__init__.py`` chain, or None outside one."""
    parts: list[str] = []
    folder = source.resolve().parent
    while (folder / "__init__.py").is_file() and folder.name.isidentifier():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts) or None


def import_package(target: Target, text: str) -> str | None:
    """The package to make relative imports absolute in, or None to keep them relative.

    They stay relative only when the output sits beside the source (the same package)
    and no ``package`` forces a rewrite; standard output counts as elsewhere. Without a
    package to use, a relative import is an error at its line.
    """
    if target.package is not None:
        return target.package
    if target.output is not None and target.output.resolve().parent == target.source.resolve().parent:
        return None
    if "from ." not in text:  # no relative import can be there
        return None
    inferred = infer_package(target.source)
    if inferred is not None:
        return inferred
    from hpgen.generator.index import index_module, parse_source

    stripped = text.removeprefix("\ufeff")
    relative = index_module(parse_source(stripped, name=str(target.source))).relative_imports
    if relative:
        need = "a relative import needs the source's package when the output is written elsewhere"
        example = 'package = "transformers.models.llama"'
        if target.origin == "command line":
            advice = f"pass --package PKG (in a [tool.hpgen] target: its package key, {example})"
        else:
            advice = f"give the target its package key, {target.origin}: {example} (on the command line: --package PKG)"
        raise HpgenError(
            f"{need}: {advice}",
            file=str(target.source),
            where=f"{relative[0].line}:1",
        )
    return None


def generate(target: Target) -> str:
    """The generated text of ``target``."""
    from hpgen.generator.lower import lower
    from hpgen.core.plan import parse_plan

    text, _ = read_source(target.source)
    plan = parse_plan(read_bytes(target.plan, "plan"), name=str(target.plan))
    return lower(text, plan, mode=target.mode, source_name=str(target.source), package=import_package(target, text))


@dataclass(frozen=True)
class Freshness:
    """What ``check`` found for one target; ``generated`` is set when it was lowered."""

    fresh: bool
    existing: str | None
    generated: str | None
    shortcut: bool  # decided from the header's verified hashes, without lowering


def check_target(target: Target, *, full: bool = False) -> Freshness:
    """Compare a target's output with what lowering would write.

    Unless ``full``, a header whose version, input hashes, options and body hash all
    verify against the files proves the output fresh without lowering.
    """
    assert target.output is not None
    existing_bytes = target.output.read_bytes() if target.output.is_file() else None
    existing = existing_bytes.decode("utf-8", "replace") if existing_bytes is not None else None
    if existing is not None and not full and _verified_fresh(target, existing):
        return Freshness(True, existing, None, shortcut=True)
    generated = generate(target)
    return Freshness(generated == existing, existing, generated, shortcut=False)


def _verified_fresh(target: Target, existing: str) -> bool:
    header = read_header(existing)
    if header is None or header.version != __version__ or header.mode != target.mode:
        return False
    if (header.source_name, header.plan_name) != (display_name(str(target.source)), display_name(str(target.plan))):
        return False
    text, source_bytes = read_source(target.source)
    if hashlib.sha256(source_bytes).hexdigest() != header.source_sha256:
        return False
    if hashlib.sha256(read_bytes(target.plan, "plan")).hexdigest() != header.plan_sha256:
        return False
    if import_package(target, text) != header.package:
        return False
    return body_is_intact(existing, header)
