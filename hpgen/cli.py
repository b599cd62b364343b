"""The command line: a thin shell over ``hpgen.generator.lower`` (docs/cli.md).

Messages go to stderr, generated code and diffs to stdout, so ``--diff > patch`` works.
Bad input exits 2 with one line naming the file and the place; an hpgen bug (generated
code that does not compile) exits 123, as black does, and writes nothing. The one
``Report`` of a run decides the exit code.

The lowering machinery is imported inside the commands that lower, so that ``hpgen
check`` on fresh targets does not pay for libcst.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from hpgen import __version__
from hpgen.core.errors import GeneratedCodeError, HpgenError, printable_path
from hpgen.generator.generate import check_target, generate, read_source
from hpgen.core.plan import is_dotted_path
from hpgen.generator.targets import MODES, BadTarget, Target, find_pyproject, load_targets
from hpgen.generator.write import EXIT_BAD_INPUT, EXIT_INTERNAL, Report, unified_diff, write_file
from hpgen.verify.prepare import ATTENTION_IMPLEMENTATIONS


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


# What the commands that build a model need beyond the generator, and the extra that installs it.
_PLAN_MODULES = ("torch", "transformers")
_PLAN_EXTRA = "pip install -e '.[plan]' in a clone of the hpgen repository"


@contextmanager
def plan_extra(command: str) -> Iterator[None]:
    """Turn a missing torch or transformers into one line naming the extra (a generator-only install)."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in _PLAN_MODULES:
            raise
        raise HpgenError(f"{command} needs torch and transformers, and {missing} is not installed: {_PLAN_EXTRA}") from None


@contextmanager
def stdout_reader_may_leave() -> Iterator[None]:
    """Let the reader of stdout go (``hpgen lower --check --diff | head``) without ending the run.

    A closed pipe is no error of the run: what goes to stdout afterwards (and Python's flush at
    exit) goes to the null device, nothing is said, and the exit status stays the run's own (1 for
    a stale target). A closed pipe behind an output file is still reported: only stdout is covered.
    """
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        try:
            fd = sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):  # not a real stream (click's test runner)
            return
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


def write_stdout(text: str) -> None:
    """Write text as bytes, so CRLF and a BOM reach stdout unchanged."""
    with stdout_reader_may_leave():
        sys.stdout.flush()
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.buffer.flush()


def echo_diff(diff: str, color: bool | None) -> None:
    """A unified diff on stdout, coloured on a terminal (or as ``--color`` says)."""
    with stdout_reader_may_leave():
        for line in diff.splitlines(keepends=True):
            body = line.rstrip("\r\n")
            if line.startswith(("+++", "---")):
                body = click.style(body, bold=True)
            elif line[:1] in _DIFF_COLOURS:
                body = click.style(body, fg=_DIFF_COLOURS[line[:1]])
            click.echo(body + line[len(line.rstrip("\r\n")) :], nl=False, color=color)


_DIFF_COLOURS = {"+": "green", "-": "red", "@": "cyan"}


def configured_targets(outputs: Iterable[str] = ()) -> list[Target | BadTarget]:
    """The ``[tool.hpgen]`` targets (bad entries among them), or those whose output is in ``outputs``."""
    pyproject = find_pyproject(Path.cwd())
    if pyproject is None:
        raise HpgenError("no pyproject.toml with a [tool.hpgen] table in this folder or above it; pass SOURCE and PLAN")
    targets = load_targets(pyproject)
    wanted = [Path(output).resolve() for output in outputs]
    if not wanted:
        return targets
    by_output: dict[Path, Target | BadTarget] = {}
    for target in targets:  # the first entry naming an output is its target; a repeat is a BadTarget
        if target.output is not None:
            by_output.setdefault(target.output.resolve(), target)
    for output, path in zip(outputs, wanted):
        if path not in by_output:
            raise HpgenError(f"{output} is not the output of any target in {pyproject}")
    return [by_output[path] for path in wanted]


def run_targets(
    targets: list[Target | BadTarget],
    *,
    check: bool,
    diff: bool,
    full: bool,
    color: bool | None,
    summary: bool = True,
    fail_on_write: bool = False,
) -> int:
    """Regenerate (or, with ``check``/``diff``, compare) each target; one report for all.

    Each file written, stale or failed gets one line on stderr; ``summary`` adds a
    closing line of counts (for target lists) and otherwise a line for an untouched file.
    ``fail_on_write`` makes a written file exit 1, as a formatter's pre-commit hook fails.
    """
    report = Report(check=check or diff, fail_on_write=fail_on_write)
    said: dict[str, str] = {}  # each error message printed so far -> the target it stopped first
    for target in targets:
        name = printable_path(target.output_name)
        try:
            if isinstance(target, BadTarget):  # a wrong [tool.hpgen] entry: reported here, in its turn
                raise target.error
            if check or diff:
                found = check_target(target, full=full)
                if found.fresh:
                    report.unchanged.append(name)
                    if not summary:
                        click.echo(f"{name} is up to date", err=True)
                    continue
                report.stale.append(name)
                click.echo(f"would regenerate {name}" + ("" if found.existing is not None else " (missing)"), err=True)
                if diff:
                    echo_diff(unified_diff(found.existing or "", found.generated or "", name, f"{name} (hpgen)"), color)
            elif write_file(target.output, generate(target).encode("utf-8")):
                report.written.append(name)
                click.echo(f"wrote {name}", err=True)
            else:
                report.unchanged.append(name)
                if not summary:
                    click.echo(f"{name} unchanged", err=True)
        except HpgenError as exc:
            report.failed.append(name)
            message = str(exc)
            if message in said:  # one bad plan (or source) behind several targets: said once
                click.echo(f"error: {name}: not written, the same error as {said[message]}", err=True)
            else:
                said[message] = name
                click.echo(f"error: {message}", err=True)
        except OSError as exc:  # a read-only folder, a full disk, a file where a folder should be...
            report.failed.append(name)
            click.echo(f"error: {name}: cannot write: {exc.strerror or exc}", err=True)
        except GeneratedCodeError as exc:
            report.internal_errors.append(name)
            click.echo(f"internal error (please report): {exc}; {name} was not written", err=True)
    if summary:
        click.echo(report.summary(), err=True)
    return report.return_code


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpgen")
def cli() -> None:
    """Lower Hugging Face modeling files and a frozen parallel plan into parallel code."""


@cli.command("lower")
@click.argument("source", required=False)
@click.argument("plan", required=False)
@click.option("-o", "--output", help="Write here instead of stdout ('-' is stdout).")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 when the output would change.")
@click.option("--diff", is_flag=True, help="Write nothing; print a unified diff of what would change.")
@click.option("--mode", type=click.Choice(MODES), default="default", show_default=True)
@click.option("--package", help="Package of SOURCE, for making its relative imports absolute.")
@click.option("--color/--no-color", default=None, help="Colour diffs (default: when stdout is a terminal).")
@click.option(
    "--exit-non-zero-on-write",
    "fail_on_write",
    is_flag=True,
    help="Exit 1 when a file was written, created ones included (the pre-commit hook).",
)
def lower_command(
    source: str | None,
    plan: str | None,
    output: str | None,
    check: bool,
    diff: bool,
    mode: str,
    package: str | None,
    color: bool | None,
    fail_on_write: bool,
) -> None:
    """Rewrite the boundary classes of SOURCE as PLAN says.

    Without SOURCE and PLAN, regenerate every target of [tool.hpgen] in pyproject.toml,
    writing only the files whose bytes change.
    """

    def run() -> int:
        if source is None:
            if output is not None or package is not None or mode != "default":
                raise HpgenError("-o, --mode and --package need SOURCE and PLAN; targets set them in pyproject.toml")
            return run_targets(
                configured_targets(), check=check, diff=diff, full=False, color=color, fail_on_write=fail_on_write
            )
        if plan is None:
            raise click.UsageError("Missing argument 'PLAN'.")
        output_file = None if output in (None, "-") else output
        return _lower_one(source, plan, output_file, check, diff, mode, package, color, fail_on_write)

    run_guarded(run)


def _lower_one(
    source: str,
    plan: str,
    output: str | None,
    check: bool,
    diff: bool,
    mode: str,
    package: str | None,
    color: bool | None,
    fail_on_write: bool,
) -> int:
    if package is not None and not is_dotted_path(package):
        raise HpgenError(f"--package {package!r} is not a dotted package name")
    if check and output is None:
        raise HpgenError("--check compares against a file: give it with -o OUTPUT")
    for what, path in (("source", source), ("plan", plan)):
        if output is not None and Path(output).resolve() == Path(path).resolve():
            raise HpgenError(f"the output would overwrite the {what}; choose another -o", file=output)
    if output is not None and Path(output).is_dir():
        raise HpgenError("the output is a folder; give a file name", file=output)
    target = Target(Path(source), Path(plan), None if output is None else Path(output), mode, package)
    if output is not None:
        return run_targets(
            [target], check=check, diff=diff, full=True, color=color, summary=False, fail_on_write=fail_on_write
        )
    generated = generate(target)
    if diff:  # no output file: show what hpgen changes in the source
        text, _ = read_source(target.source)
        echo_diff(unified_diff(text, generated, source, f"{source} (hpgen)"), color)
    else:
        write_stdout(generated)
    return 0


@cli.command("check")
@click.argument("outputs", nargs=-1)
@click.option("--full", is_flag=True, help="Lower every target again instead of trusting verified header hashes.")
@click.option("--color/--no-color", default=None, help="Colour diffs (default: when stdout is a terminal).")
def check_command(outputs: tuple[str, ...], full: bool, color: bool | None) -> None:
    """Exit 1 with a unified diff when a [tool.hpgen] target is stale (for CI).

    Stale means the output is missing, hand-edited, or would differ after regeneration
    (its source, plan or the hpgen version changed). OUTPUTS limit the check to those
    targets.
    """
    run_guarded(lambda: run_targets(configured_targets(outputs), check=True, diff=True, full=full, color=color))


@cli.command("explain")
@click.argument("source")
@click.argument("plan")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option("--config", "config", help="A model type or config.json: add the sizing report for that model.")
@click.option("--tp", type=click.IntRange(min=1), help="Ranks for the sizing report (default 2).")
@click.option(
    "--dtype", help="Parameter and activation dtype for the sizing report (default: the config's, else bfloat16)."
)
def explain_command(
    source: str, plan: str, as_json: bool, config: str | None, tp: int | None, dtype: str | None
) -> None:
    """Per class: FQNs, form, each op and why, and collectives per forward call.

    With --config, also the parameter bytes per rank and the collectives per decoder layer
    and per token, computed on the meta device (no weights).
    """

    def run() -> int:
        from hpgen.generator.explain import explain, explain_text
        from hpgen.generator.lower import analyze
        from hpgen.core.plan import load_plan

        text, _ = read_source(Path(source))
        loaded = load_plan(plan)
        report = explain(analyze(text, loaded, source_name=source))
        sizing = None
        if config is not None:
            from hpgen.planner.entry.printout import sizing_for

            with plan_extra("hpgen explain --config"):
                sizing = sizing_for(config, loaded, tp=tp or 2, dtype=dtype)
        stages = _pipeline_stages(loaded, config)
        if as_json:
            if sizing is not None:
                report = {**report, "sizing": sizing.as_dict()}
            if stages is not None:
                report = {**report, "pipeline": stages}
            click.echo(json.dumps(report, indent=2, sort_keys=True))
        else:
            click.echo(explain_text(report), nl=False)
            if stages is not None:
                click.echo("\n" + "\n".join(stages["lines"]) + "\n", nl=False)
            if sizing is not None:
                click.echo("\n" + sizing.text() + "\n", nl=False)
        return 0

    run_guarded(run)


def _pipeline_stages(plan: Any, config: str | None) -> dict[str, Any] | None:
    """The plan's pipeline stages for ``hpgen explain``: modules, and parameter counts with ``--config``."""
    if plan.pipeline is None:
        return None
    from hpgen.planner.passes.pipeline_stages import stages_text

    params = None
    if config is not None:
        from hpgen.planner.model.load import load_config, meta_model
        from hpgen.planner.passes.pipeline_stages import stage_params

        with plan_extra("hpgen explain --config"):
            params = stage_params(meta_model(load_config(config)), plan.pipeline.stages)
    return {
        "axis": plan.pipeline.axis,
        "stages": [list(stage) for stage in plan.pipeline.stages],
        "params": list(params) if params is not None else None,
        "lines": [f"pipeline stages over {plan.pipeline.axis}:", *stages_text(plan.pipeline.stages, params)],
    }


@cli.command("plan")
@click.argument("model")
@click.option("--tp", type=click.IntRange(min=1), help="Tensor-parallel size the plan must divide (heads).")
@click.option("--sp", is_flag=True, help="Keep the residual stream sequence-sharded between decoder layers.")
@click.option(
    "--cp",
    type=click.IntRange(min=1),
    help="Context parallelism: cut the sequence over this many ranks of a 'cp' axis (outside tp).",
)
@click.option("--ep", type=click.IntRange(min=1), help="Shard the experts by expert over this many ranks.")
@click.option(
    "--ep-axis",
    metavar="NAME",
    help="Put the experts on an axis of their own (mesh NAME x tp); without it they share tp.",
)
@click.option(
    "--attn-dp",
    is_flag=True,
    help="With --ep: attention and dense layers data-parallel over the expert ranks, tokens gathered into the experts "
    "(with --tp: attention tensor-parallel inside each data-parallel group, mesh ep x tp).",
)
@click.option(
    "--pp",
    type=click.IntRange(min=1),
    help="Pipeline stages: cut the decoder layers over this many ranks of a 'pp' axis (outermost), balanced by parameters.",
)
@click.option(
    "--pp-layers",
    metavar="N,N,...",
    help="With --pp: the decoder layers of each stage, first to last (3,5), instead of the balanced cut.",
)
@click.option("--from-source", is_flag=True, help="Derive the plan from the modeling source even where transformers has one.")
@click.option(
    "--no-summed-reduction",
    "no_summed",
    is_flag=True,
    help="Reduce a parallel-residual block's attention and MLP separately (two collectives, not one).",
)
@click.option("--explain", "show_notes", is_flag=True, help="Say on stderr what was sharded and why the rest was not.")
@click.option("--dtype", help="Dtype of the sizing report printed on stderr (default: the config's, else bfloat16).")
@click.option("-o", "--output", help="Write the plan here instead of stdout ('-' is stdout).")
def plan_command(
    model: str,
    tp: int | None,
    sp: bool,
    cp: int | None,
    ep: int | None,
    ep_axis: str | None,
    attn_dp: bool,
    pp: int | None,
    pp_layers: str | None,
    from_source: bool,
    no_summed: bool,
    show_notes: bool,
    dtype: str | None,
    output: str | None,
) -> None:
    """Write a frozen plan for MODEL (a transformers model type or a config.json).

    transformers' own tp_plan is translated where it shards the decoder layers; otherwise
    (or with --from-source) the plan is derived from the modeling source. With --tp, a
    sizing report (parameter bytes per rank, collectives per layer and per token) goes to
    stderr.
    """

    def run() -> int:
        from hpgen.planner.entry.printout import plan_with_report

        layer_counts = None
        if pp_layers is not None:
            try:
                layer_counts = tuple(int(part) for part in pp_layers.split(","))
            except ValueError:
                raise HpgenError(f"--pp-layers {pp_layers}: expected comma-separated layer counts (3,5)") from None
        with plan_extra("hpgen plan"):
            text, messages = plan_with_report(
                model,
                tp=tp,
                ep=ep,
                sp=sp,
                ep_axis=ep_axis,
                from_source=from_source,
                summed=not no_summed,
                notes=show_notes,
                dtype=dtype,
                cp=cp,
                attn_dp=attn_dp,
                pp=pp,
                pp_layers=layer_counts,
            )
        for message in messages:
            click.echo(message, err=True)
        if output in (None, "-"):
            write_stdout(text)
        else:
            try:
                written = write_file(output, text.encode("utf-8"))
            except OSError as exc:  # a read-only folder, a folder as -o, a full disk...
                raise HpgenError(f"cannot write: {exc.strerror or exc}", file=output) from None
            click.echo(f"wrote {output}" if written else f"{output} unchanged", err=True)
        return 0

    run_guarded(run)


@cli.command("verify")
@click.argument("plan")
@click.argument("model", required=False)
@click.option("--source", metavar="MODELING.py", help="The modeling file to lower (default: the installed transformers').")
@click.option("--ranks", type=click.IntRange(min=1), help="Gloo ranks (default: 2 an axis, the product over the plan's axes).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text (for CI).")
@click.option(
    "--trust-plan-code",
    is_flag=True,
    help="Let the plan's injections import functions of any module (by default: hpgen's own only).",
)
@click.option(
    "--trust-module",
    "trusted_modules",
    metavar="NAME",
    multiple=True,
    help="Let the plan's injections import functions of module NAME and the modules under it (repeatable).",
)
@click.option(
    "--attn-implementation",
    type=click.Choice(ATTENTION_IMPLEMENTATIONS),
    help="transformers' attention path both models run (default: transformers' default, sdpa).",
)
def verify_command(
    plan: str,
    model: str | None,
    source: str | None,
    ranks: int | None,
    as_json: bool,
    trust_plan_code: bool,
    trusted_modules: tuple[str, ...],
    attn_implementation: str | None,
) -> None:
    """Prove PLAN exact on a tiny copy of its model, on gloo ranks on the CPU.

    MODEL is a model type, config.json or checkpoint folder (only its config is read); without
    it, the plan's model_class with transformers' default config. The config is shrunk so that
    every sharded dim still divides; the parallelized model is compared with the unsharded one
    (logits, every gradient, greedy generation; in train mode with dropout, the ranks agree). Exit 0
    exact, 1 with a report naming the first boundary that differs, 2 bad input (a plan whose injections
    name a function outside hpgen's own, unless --trust-plan-code or --trust-module says so, included).
    """

    def run() -> int:
        with plan_extra("hpgen verify"):
            from hpgen.verify.command import verify_command as body

            return body(plan, model, source, ranks, as_json, trust_plan_code, trusted_modules, attn_implementation)

    run_guarded(run)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="hpgen")


if __name__ == "__main__":
    main()
