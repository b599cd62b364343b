"""``hpgen verify``'s command body: prepare, run on ranks, report; progress on stderr.

Kept apart from :mod:`hpgen.cli` so that the command line imports torch and transformers
only for the commands that build a model.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

from hpgen.core.errors import HpgenError

__all__ = ["verify_command"]


_STARTED = time.monotonic()


def _progress(text: str) -> None:
    print(f"hpgen verify: [{time.monotonic() - _STARTED:5.1f}s] {text}", file=sys.stderr, flush=True)


def _require_torch_and_transformers() -> None:
    """Fail before any progress line or process when torch or transformers is missing (a generator-only
    install), so that the command's only output is the one line naming the extra."""
    for name in ("torch", "transformers"):
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def verify_command(
    plan: str,
    model: str | None,
    source: str | None,
    ranks: int | None,
    as_json: bool,
    trust_plan_code: bool = False,
    trusted_modules: tuple[str, ...] = (),
    attn_implementation: str | None = None,
) -> int:
    """Exit 0 when the plan is exact on the tiny model, 1 with the report; bad input (and a tiny copy that
    transformers' own model cannot run) raises HpgenError."""
    global _STARTED
    started = _STARTED = time.monotonic()  # before the imports of torch and transformers: they are part of it
    _require_torch_and_transformers()
    from hpgen.verify.spawn import start_server

    start_server()  # the ranks' forkserver imports torch and transformers while this process does too
    _progress("importing torch and transformers")
    from hpgen.verify.prepare import prepare
    from hpgen.verify.report import finding, planner_plan, report_json, report_text
    from hpgen.verify.run import verify_many

    with tempfile.TemporaryDirectory(prefix="hpgen-verify-") as folder:
        _progress(f"shrinking the config and lowering the modeling file with {plan}")
        case = prepare(
            plan, Path(folder), model=model, source=source, ranks=ranks,
            trust_plan_code=trust_plan_code, trusted_modules=trusted_modules, attn_implementation=attn_implementation,
        )  # fmt: skip
        _progress(f"lowered {Path(case.source).name}; spawning {case.world_size} gloo ranks")
        (verdict,) = verify_many([case])
    if verdict.reference_error:  # the tiny config, not the plan: nothing was proven either way
        raise HpgenError(f"cannot verify on a tiny copy: {verdict.reference_error}")
    found = None
    if not verdict.exact:
        _progress("localizing: asking hpgen plan what it would declare")
        found = finding(verdict, planner_plan(verdict))
    seconds = time.monotonic() - started
    _progress(f"done in {seconds:.1f}s")
    if as_json:
        sys.stdout.write(json.dumps(report_json(verdict, found, seconds), indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(report_text(verdict, found))
    return 0 if verdict.exact else 1
