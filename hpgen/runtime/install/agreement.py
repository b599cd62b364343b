"""Every rank runs the same program: one plan, one generated file, one hpgen.

Ranks that disagree do not fail cleanly: a rank with another plan issues other
collectives, so one rank gets wrong numbers while its peer dies on "Connection closed by
peer", or every rank hangs. (``examples/tp_llama.py`` lowers a copy of the modeling file
on every rank, so a multi-node job with mixed installs does exactly this.)

:func:`check_ranks_agree` runs before ``parallelize`` changes anything: each rank hashes
what it was given (the hpgen version, the plan's content, and the header of every
generated file whose classes the model uses), the hashes are all-gathered over each plan
axis (one small tensor), and on any difference every rank raises, naming the ranks that
differ and what differs.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hpgen import __version__
from hpgen.core.header import read_header
from hpgen.core.plan import Plan
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.forward.devices import collective_device
from hpgen.runtime.forward.handback import all_gather_object, call

__all__ = ["check_ranks_agree", "raise_together", "rank_record"]

_DIGEST_WORDS = 4  # the first 32 bytes of a sha256, as int64s


def _generated_files(model: nn.Module) -> dict[str, str]:
    """File name -> what its header records, for each generated file the model's classes come from."""
    found: dict[str, str] = {}
    for module in model.modules():
        for cls in type(module).__mro__:
            if "_hp_boundary_form" not in vars(cls):
                continue
            source_module = sys.modules.get(cls.__module__)
            path = getattr(source_module, "__file__", None)
            if path is None or path in found:
                continue
            try:
                header = read_header(Path(path).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError):
                # Deleted since it was imported (a temporary folder): nothing to compare but the
                # plan and the version; the same words on every rank, so no false refusal.
                found[path] = "not readable any more"
                continue
            if header is None:
                found[path] = "no hpgen header"
            else:
                found[path] = (
                    f"hpgen {header.version}, source {header.source_name} sha256={header.source_sha256[:12]}, "
                    f"plan {header.plan_name} sha256={header.plan_sha256[:12]}, mode={header.mode}, "
                    f"body sha256={header.body_sha256[:12]}"
                )
    # Keyed by base name: module names and folders may differ between ranks, contents may not.
    return {Path(path).name: text for path, text in sorted(found.items())}


def rank_record(model: nn.Module, plan: Plan) -> dict[str, object]:
    """What this rank was given, as it is compared with the other ranks'."""
    return {
        "hpgen version": __version__,
        "plan": f"{plan.name} (content sha256={plan.digest()[:12]})",
        "plan content": plan.digest(),
        "generated files": _generated_files(model),
    }


def _digest(record: Mapping[str, object]) -> torch.Tensor:
    compared = {key: value for key, value in record.items() if key != "plan"}  # the file name may differ
    raw = hashlib.sha256(json.dumps(compared, sort_keys=True).encode()).digest()
    return torch.tensor([int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, 32, 8)])


def _differences(other: Mapping[str, object], first: Mapping[str, object]) -> list[str]:
    """What ``other`` was given that ``first`` was not, each as ``what: other's vs first's``."""
    found = []
    if other["hpgen version"] != first["hpgen version"]:
        found.append(f"hpgen version: {other['hpgen version']} vs {first['hpgen version']}")
    if other["plan content"] != first["plan content"]:
        found.append(f"plan: {other['plan']} vs {first['plan']}")
    files_other, files_first = other["generated files"], first["generated files"]
    assert isinstance(files_other, dict) and isinstance(files_first, dict)
    for name in sorted({*files_other, *files_first}):
        theirs, ours = files_other.get(name, "not used"), files_first.get(name, "not used")
        if theirs != ours:
            found.append(f"generated file {name}: {theirs} vs {ours}")
    return found


def raise_together(error: ParallelizeError | None, mesh: DeviceMesh, axes: Iterable[str]) -> None:
    """Raise on every rank if any rank of an axis has ``error``: a refusal on one rank alone
    would leave its peers waiting in their first collective."""
    for axis in axes:
        group = mesh.get_group(axis)
        size = dist.get_world_size(group)
        if size == 1:
            continue
        failed = torch.tensor([0 if error is None else 1], device=collective_device(mesh))
        call(dist.all_reduce, failed, group=group)
        if not failed.item():
            continue
        messages = all_gather_object(None if error is None else str(error), group, collective_device(mesh))
        if error is not None:
            raise error
        ranks = dist.get_process_group_ranks(group)
        rank, message = next((ranks[i], m) for i, m in enumerate(messages) if m is not None)
        raise ParallelizeError(f"rank {rank} of axis {axis!r} refused the plan, so this rank stops too: {message}")


def check_ranks_agree(model: nn.Module, plan: Plan, mesh: DeviceMesh, axes: Iterable[str]) -> None:
    """Raise :class:`ParallelizeError` on every rank unless all ranks of each axis were given the same."""
    record = rank_record(model, plan)
    mine = _digest(record).to(collective_device(mesh))
    for axis in axes:
        group = mesh.get_group(axis)
        size = dist.get_world_size(group)
        if size == 1:
            continue
        digests = [torch.empty_like(mine) for _ in range(size)]
        call(dist.all_gather, digests, mine, group=group)
        if all(torch.equal(d, digests[0]) for d in digests):
            continue
        records = all_gather_object(record, group, mine.device)
        ranks = dist.get_process_group_ranks(group)
        lines = []
        for index in range(1, size):
            if not torch.equal(digests[index], digests[0]):
                other, first = records[index], records[0]
                assert other is not None and first is not None
                for difference in _differences(other, first):
                    lines.append(f"  rank {ranks[index]} vs rank {ranks[0]}: {difference}")
        raise ParallelizeError(
            f"the ranks of axis {axis!r} were not given the same program, so their collectives would not match "
            "(wrong results or a hang). Give every rank the same plan, the same generated file and the same hpgen:\n"
            + "\n".join(lines)
        )
