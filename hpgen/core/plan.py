"""The frozen parallel plan (docs/plan-format.md): loading it, and the names every layer imports from here.

A plan file is read and decoded here, validated by :mod:`hpgen.core.plan_reader` and becomes
the plain data of :mod:`hpgen.core.plan_entries`; :mod:`hpgen.core.plan_names` holds the name checks
and FQN pattern matching. Those modules' public names are importable from this one.

These modules need nothing beyond the standard library, so the runtime can use them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from hpgen.core.errors import HpgenError
from hpgen.core.plan_entries import (
    Entry,
    FunctionRef,
    Injection,
    Layout,
    LocalCount,
    Plan,
    SummedBranch,
    SummedReduction,
    body_is_sharded,
    contract_signature,
    iter_layouts,
    summed_branches,
)
from hpgen.core.plan_names import fqn_matches, is_dotted_path, is_fqn_pattern, is_identifier, is_param_path, patterns_overlap
from hpgen.core.plan_reader import PLAN_FORMAT, PLAN_FORMAT_2, PLAN_FORMATS, RESERVED_AXIS_NAMES, PlanReader

__all__ = [
    "PLAN_FORMAT",
    "PLAN_FORMATS",
    "PLAN_FORMAT_2",
    "RESERVED_AXIS_NAMES",
    "Entry",
    "FunctionRef",
    "Injection",
    "Layout",
    "LocalCount",
    "Plan",
    "SummedBranch",
    "SummedReduction",
    "body_is_sharded",
    "contract_signature",
    "fqn_matches",
    "is_dotted_path",
    "is_fqn_pattern",
    "is_identifier",
    "is_param_path",
    "iter_layouts",
    "load_plan",
    "parse_plan",
    "patterns_overlap",
    "plan_from_dict",
    "summed_branches",
]


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate a plan file; errors name the file and the JSON path."""
    name = os.fspath(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise HpgenError(f"cannot read plan: {exc.strerror or exc}", file=name) from None
    return parse_plan(data, name=name)


def parse_plan(data: bytes | str, *, name: str = "<plan>") -> Plan:
    """Parse and validate plan JSON text."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise HpgenError(f"not UTF-8 text (byte {exc.start})", file=name) from None
    try:
        document = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except _DuplicateKey as exc:
        raise HpgenError(f"duplicate key {exc.key!r} in one JSON object", file=name) from None
    except json.JSONDecodeError as exc:
        raise HpgenError(f"invalid JSON: {exc.msg}", file=name, where=f"{exc.lineno}:{exc.colno}") from None
    except RecursionError:
        raise HpgenError("invalid JSON: nested too deeply", file=name) from None
    except ValueError as exc:  # an integer literal longer than int's string limit (4300 digits)
        raise HpgenError(f"invalid JSON: {str(exc).split(':', 1)[0]}", file=name) from None
    return plan_from_dict(document, name=name, sha256=hashlib.sha256(raw).hexdigest())


def plan_from_dict(document: object, *, name: str = "<plan>", sha256: str | None = None) -> Plan:
    """Validate a decoded plan document and build the ``Plan``."""
    if sha256 is None:
        canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), default=str)
        sha256 = hashlib.sha256(canonical.encode()).hexdigest()
    try:
        return PlanReader(name).read(document, sha256)
    except HpgenError as exc:
        raise exc.located(name) from None


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result
