"""The command line: a thin shell over ``hpgen.lower`` (SPEC §5).

Messages go to stderr, generated code and diffs to stdout, so ``--diff > patch`` works.
Bad input exits 2 with one line naming the file and the place; an hpgen bug (generated
code that does not compile) exits 123, as black does, and writes nothing.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import click

from hpgen import __version__
from hpgen.errors import HpgenError
from hpgen.explain import explain, explain_text
from hpgen.lower import MODES, GeneratedCodeError, analyze, lower
from hpgen.plan import is_dotted_path, load_plan
from hpgen.write import (
    EXIT_BAD_INPUT,
    Report,
    atomic_write,
    read_existing,
    unified_diff,
)

EXIT_INTERNAL = 123


def read_source(path: str) -> str:
    """The source text (UTF-8, a BOM kept as U+FEFF, line endings untouched)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise HpgenError(f"cannot read source: {exc.strerror or exc}", file=path) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise HpgenError("source is not UTF-8 text", file=path, where=f"{line}:1") from None


def infer_package(source: Path) -> str | None:
    """The package of ``source`` from its ``__init__.py`` chain, or None outside one."""
    parts: list[str] = []
    folder = source.resolve().parent
    while (folder / "__init__.py").is_file() and folder.name.isidentifier():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts) or None


def import_package(source: str, output: str | None, package: str | None, text: str) -> str | None:
    """The package to make relative imports absolute in, or None to keep them relative.

    They stay relative only when the output sits beside the source (same package) and
    no ``--package`` forces a rewrite. Output to stdout counts as outside.
    """
    if package is not None:
        return package
    source_path = Path(source)
    if output is not None and Path(output).resolve().parent == source_path.resolve().parent:
        return None
    if "from ." not in text:  # cheap pre-check; the index below decides
        return None
    inferred = infer_package(source_path)
    if inferred is not None:
        return inferred
    from hpgen.index import index_module, parse_source

    stripped = text.removeprefix("\ufeff")
    relative = index_module(parse_source(stripped, name=source)).relative_imports
    if relative:
        raise HpgenError(
            "a relative import needs the source's package when the output is written elsewhere: pass --package",
            file=source,
            where=f"{relative[0].line}:1",
        )
    return None


def run_guarded(action: Callable[[], int]) -> None:
    """Run a command body, turning bad input into exit 2 and bugs into exit 123."""
    try:
        code = action()
    except HpgenError as exc:
        click.echo(f"error: {exc}", err=True)
        code = EXIT_BAD_INPUT
    except GeneratedCodeError as exc:
        click.echo(f"internal error (please report): {exc}; nothing was written", err=True)
        code = EXIT_INTERNAL
    sys.exit(code)


def write_stdout(text: str) -> None:
    """Write text as bytes, so CRLF and a BOM reach stdout unchanged."""
    stream = sys.stdout.buffer
    stream.write(text.encode("utf-8"))
    stream.flush()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpgen")
def cli() -> None:
    """Lower Hugging Face modeling files and a frozen parallel plan into parallel code."""


@cli.command("lower")
@click.argument("source")
@click.argument("plan")
@click.option("-o", "--output", help="Write here instead of stdout ('-' is stdout).")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 when OUTPUT would change.")
@click.option("--diff", is_flag=True, help="Write nothing; print a unified diff of what would change.")
@click.option("--mode", type=click.Choice(MODES), default="default", show_default=True)
@click.option("--package", help="Package of SOURCE, for making its relative imports absolute.")
def lower_command(source: str, plan: str, output: str | None, check: bool, diff: bool, mode: str, package: str | None) -> None:
    """Rewrite the boundary classes of SOURCE as PLAN says."""
    run_guarded(lambda: _lower(source, plan, None if output == "-" else output, check, diff, mode, package))


def _lower(source: str, plan_path: str, output: str | None, check: bool, diff: bool, mode: str, package: str | None) -> int:
    if package is not None and not is_dotted_path(package):
        raise HpgenError(f"--package {package!r} is not a dotted package name")
    if check and output is None:
        raise HpgenError("--check compares against a file: give it with -o OUTPUT")
    if output is not None and Path(output).resolve() == Path(source).resolve():
        raise HpgenError("the output would overwrite the source; choose another -o", file=output)
    text = read_source(source)
    plan = load_plan(plan_path)
    generated = lower(
        text, plan, mode=mode, source_name=source, package=import_package(source, output, package, text)
    )
    report = Report(check=check)
    if check or diff:
        before_name, before_bytes = (output, read_existing(output)) if output is not None else (source, text.encode())
        before = (before_bytes or b"").decode("utf-8", "replace")
        changed = before != generated
        if diff and changed:
            click.echo(unified_diff(before, generated, before_name, f"{before_name} (hpgen)"), nl=False)
        if check:
            (report.stale if changed else report.unchanged).append(output)
            click.echo(f"would regenerate {output}" if changed else f"{output} is up to date", err=True)
        return report.return_code
    if output is None:
        write_stdout(generated)
        return report.return_code
    if atomic_write(output, generated.encode("utf-8")):
        report.written.append(output)
        click.echo(f"wrote {output}", err=True)
    else:
        report.unchanged.append(output)
        click.echo(f"{output} unchanged", err=True)
    return report.return_code


@cli.command("explain")
@click.argument("source")
@click.argument("plan")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def explain_command(source: str, plan: str, as_json: bool) -> None:
    """Per class: FQNs, form, each op and why, and collectives per forward call."""

    def run() -> int:
        report = explain(analyze(read_source(source), load_plan(plan), source_name=source))
        click.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else explain_text(report), nl=as_json)
        return 0

    run_guarded(run)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="hpgen")


if __name__ == "__main__":
    main()
