"""The names a plan may hold, and how its FQN patterns match (``*`` stands for one segment).

Every name that can reach generated source is checked with these before any code is
generated (:mod:`hpgen.core.plan_reader`); the runtime and the generator match module FQNs
against the plan's keys with :func:`fqn_matches`.
"""

from __future__ import annotations

import keyword

__all__ = ["fqn_matches", "is_dotted_path", "is_fqn_pattern", "is_identifier", "is_param_path", "patterns_overlap"]


def is_identifier(name: object) -> bool:
    """True for a Python identifier that is not a keyword (``hidden_states``, ``tp``)."""
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name) and name.isascii()


def is_dotted_path(name: object) -> bool:
    """True for ``a.b.c`` where each part is an identifier (``hpgen.runtime.local.fn``)."""
    return isinstance(name, str) and all(is_identifier(part) for part in name.split("."))


def is_param_path(name: object) -> bool:
    """True for a parameter path relative to a module: identifiers and list indices."""
    return isinstance(name, str) and all(
        is_identifier(part) or (part.isdigit() and part.isascii()) for part in name.split(".")
    )


def is_fqn_pattern(name: object) -> bool:
    """True for a module FQN in which ``*`` may stand for exactly one segment."""
    return isinstance(name, str) and all(
        part == "*" or is_identifier(part) or (part.isdigit() and part.isascii()) for part in name.split(".")
    )


def fqn_matches(pattern: str, fqn: str) -> bool:
    """True when ``pattern`` (``*`` = one segment) matches the concrete or pattern ``fqn``."""
    left, right = pattern.split("."), fqn.split(".")
    return len(left) == len(right) and all(a == "*" or a == b for a, b in zip(left, right))


def patterns_overlap(first: str, second: str) -> bool:
    """True when some FQN is matched by both patterns."""
    left, right = first.split("."), second.split(".")
    return len(left) == len(right) and all(a == b or "*" in (a, b) for a, b in zip(left, right))
