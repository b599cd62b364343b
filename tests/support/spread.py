"""A test's own preparation (planning, lowering) spread over two processes, so that it uses both cores.

A module's fixture that plans and lowers dozens of models before its one gloo run does that work
on one core while the other waits. :func:`spread` calls ``fn(item)`` for each item on the ranks of
:func:`tests.support.dist.run_distributed` (forked from the session's forkserver, torch and transformers
already imported), the items of one ``key`` on one rank (they share its caches: a model type's modules
and plans), and returns the results in the items' order, as ``[fn(item) for item in items]`` would.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from tests.support.dist import run_distributed

__all__ = ["spread"]


def spread(
    fn: Callable[[Any], Any], items: list[Any], key: Callable[[Any], Hashable], world_size: int = 2, timeout: float = 600.0
) -> list[Any]:
    """``[fn(item) for item in items]``, computed on ``world_size`` processes. ``fn`` is a module-level function
    and the items and results are picklable (as for ``run_distributed``); ``key`` runs here."""
    groups: dict[Hashable, list[int]] = {}
    for index, item in enumerate(items):
        groups.setdefault(key(item), []).append(index)
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for indices in sorted(groups.values(), key=len, reverse=True):  # the largest groups first, each to the lightest
        min(shares, key=len).extend(indices)
    work = [[(index, items[index]) for index in share] for share in shares]
    results: list[Any] = [None] * len(items)
    for done in run_distributed(_rank, fn, work, world_size=world_size, timeout=timeout):
        for index, value in done:
            results[index] = value
    return results


def _rank(rank: int, world_size: int, fn: Callable[[Any], Any], work: list[list[tuple[int, Any]]]) -> list[tuple[int, Any]]:
    return [(index, fn(item)) for index, item in work[rank]]
