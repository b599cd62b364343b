"""Run prepared cases on gloo ranks: one spawn for many cases, the ranks' findings merged per case.

:func:`verify_many` groups the cases by world size and runs each group in one spawn
(:func:`hpgen.verify.spawn.run_distributed`): a test corpus of dozens of plans costs one
process start-up, not dozens. Each case's rank outcomes become one :class:`Verdict`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpgen.verify.compare import Check, Outcome, Raised
from hpgen.verify.localize import Difference
from hpgen.verify.prepare import Prepared

__all__ = ["Verdict", "verify_many"]


@dataclass(frozen=True)
class Verdict:
    """What the ranks found for one case, merged: the worst of every check, the first difference."""

    case: Prepared
    checks: tuple[Check, ...]
    raised: Raised | None
    forward: Difference | None
    backward: Difference | None
    params: tuple[Difference, ...]
    reference_error: str = ""
    spawn_error: str = ""  # the ranks failed as a whole (a rank died or hung)

    @property
    def exact(self) -> bool:
        return (
            not self.raised and not self.reference_error and not self.spawn_error and all(c.ok for c in self.checks)
        )


def verify_many(cases: list[Prepared], *, timeout: float = 120.0, progress: bool = True) -> list[Verdict]:
    """Each case's verdict; the cases of one world size share one spawn of that many ranks."""
    from hpgen.verify.compare import run_cases
    from hpgen.verify.spawn import RankFailed, run_distributed

    by_size: dict[int, list[Prepared]] = {}
    for case in cases:
        by_size.setdefault(case.world_size, []).append(case)
    verdicts: dict[str, Verdict] = {}
    for world_size, group in by_size.items():
        try:
            ranks = run_distributed(
                run_cases, group, progress, world_size=world_size, timeout=timeout * len(group)
            )
        except RankFailed as failure:
            text = _first_failure(failure)
            if len(group) > 1:  # one case took the spawn down: run each alone, to name it
                for case, verdict in zip(group, verify_many(group[:1], timeout=timeout, progress=progress)):
                    verdicts[case.name] = verdict
                for verdict in verify_many(group[1:], timeout=timeout, progress=progress):
                    verdicts[verdict.case.name] = verdict
                continue
            verdicts[group[0].name] = Verdict(group[0], (), None, None, None, (), spawn_error=text)
            continue
        for index, case in enumerate(group):
            verdicts[case.name] = _merged(case, [outcomes[index] for outcomes in ranks])
    return [verdicts[case.name] for case in cases]


def _merged(case: Prepared, outcomes: list[Outcome]) -> Verdict:
    checks: dict[str, Check] = {}
    for outcome in outcomes:
        for check in outcome.checks:
            held = checks.get(check.name)
            if held is None or (held.ok and not check.ok) or (held.ok == check.ok and check.err > held.err):
                checks[check.name] = check
    first = outcomes[0]
    raised = next((o.raised for o in outcomes if o.raised), None)
    forward = next((o.forward for o in outcomes if o.forward), None)
    backward = next((o.backward for o in outcomes if o.backward), None)
    params = next((o.params for o in outcomes if o.params), [])
    return Verdict(
        case, tuple(checks.values()), raised, forward, backward, tuple(params), first.reference_error
    )


def _first_failure(failure: Any) -> str:
    failures = getattr(failure, "failures", {}) or {}
    text = next(iter(failures.values()), str(failure))
    lines = [line for line in text.strip().splitlines() if line.strip() and not line.startswith((" ", "\t"))]
    return (lines[-1] if lines else text).strip()[:400]
