"""The one error type of bad input, carrying the file and the place it points at."""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable


def printable_path(path: str) -> str:
    """``path`` as is when printable, else JSON-quoted: it can never break a message line."""
    return path if path.isprintable() else json.dumps(path)


class HpgenError(Exception):
    """Bad input: a plan, a source or a usage error that the user must fix.

    ``where`` is the place inside ``file``: a JSON path for plans
    (``param_plan["model.layers.*.mlp"].out_src``) or ``line:column`` for sources.
    The command line prints ``file:where: message`` and exits 2.
    """

    def __init__(self, message: str, *, file: str | None = None, where: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.file = file
        self.where = where

    def located(self, file: str) -> HpgenError:
        """Return this error with ``file`` filled in when it has none yet."""
        if self.file is None:
            self.file = file
        return self

    def __str__(self) -> str:
        file = printable_path(self.file) if self.file else None
        prefix = ":".join(part for part in (file, self.where) if part)
        return f"{prefix}: {self.message}" if prefix else self.message


class GeneratedCodeError(Exception):
    """The generated code does not compile: a bug in hpgen, never the user's input."""


def did_you_mean(name: str, candidates: Iterable[str], *, shown: Callable[[str], str] = str) -> str:
    """``" (did you mean 'self_attn'?)"`` for the names close to a misspelt one, else ``""``.

    ``shown`` turns a close name into what the message prints (the whole module path).
    Only the standard library, so the runtime's messages use it too.
    """
    scored = [(difflib.SequenceMatcher(None, name, found).ratio(), found) for found in sorted(set(candidates))]
    best = max((score for score, _ in scored), default=0.0)
    if best < 0.6:  # difflib.get_close_matches' cutoff
        return ""
    close = [found for score, found in scored if score == best][:3]  # the closest only, ties together
    return " (did you mean " + " or ".join(repr(shown(found)) for found in close) + "?)"
