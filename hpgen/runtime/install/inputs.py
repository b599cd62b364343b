"""The check that the ranks of each axis were fed the same inputs (on by default).

Every rank of a tensor-parallel group computes a piece of the same batch, so they must
all be given the same ``input_ids``, masks and labels. The classic mistake is a
``DistributedSampler`` over the whole world (each rank its own batch) instead of over
the data-parallel ranks: nothing fails, each rank silently trains on a mix of batches.

:class:`InputCheck`, a forward pre-hook of the model ``parallelize`` was given, compares
on the first :data:`CHECKED_FORWARDS` forwards a digest of every tensor argument (names,
shapes, dtypes and contents: one all-gather of four integers per axis). When the digests
differ, every rank of the axis raises the same ``RuntimeError`` naming the ranks and the
inputs that differ. ``parallelize(..., check_inputs=False)`` turns it off (for a model
whose inputs are meant to differ across the ranks, as under context parallelism), and
``check_inputs=("tp",)`` keeps it on only the axes named (the ranks of the other axes
serve requests of their own, as under data-parallel attention).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hpgen.runtime.forward.handback import all_gather_object, call

__all__ = ["CHECKED_FORWARDS", "InputCheck", "input_digests"]

CHECKED_FORWARDS = 3
_SAMPLE = 1 << 20  # at most this many elements of a tensor enter its digest (a strided sample)
_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensor_digest(tensor: Tensor) -> int:
    """The tensor's bits, read as integers, summed with position weights (int64 arithmetic, wrapping)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() > _SAMPLE:
        flat = flat[:: flat.numel() // _SAMPLE]
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():
        flat = flat.contiguous().view(_INTEGER[flat.element_size()])
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 65521 + 1
    return int((flat.to(torch.int64) * weights).sum().item())


def input_digests(args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """Name (``arg0``, ``input_ids``, ...) -> (shape and dtype, content digest) of each tensor input."""
    values = [(f"arg{index}", value) for index, value in enumerate(args)] + sorted(kwargs.items())
    return {
        name: (f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}", _tensor_digest(value))
        for name, value in values
        if isinstance(value, Tensor) and value.device.type != "meta"
    }


def _summary(digests: Mapping[str, tuple[str, int]], device: torch.device) -> Tensor:
    """Four integers standing for all of ``digests``: the same on two ranks only for the same inputs."""
    text = ";".join(f"{name}:{layout}:{digest}" for name, (layout, digest) in digests.items())
    encoded = text.encode()
    total = sum(digest for _, digest in digests.values()) & 0x7FFFFFFF
    values = [len(digests), zlib.crc32(encoded), zlib.adler32(encoded), total]
    return torch.tensor(values, dtype=torch.int64, device=device)


class InputCheck:
    """Forward pre-hook of the model: its first forwards' inputs must be the same on every rank of each axis."""

    def __init__(self, groups: Sequence[tuple[str, dist.ProcessGroup]], device: torch.device) -> None:
        self.groups = tuple(groups)
        self.device = device
        self.left = CHECKED_FORWARDS

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.left <= 0 or torch.compiler.is_compiling():
            return None
        self.left -= 1
        digests = input_digests(args, kwargs)
        mine = _summary(digests, self.device)
        for axis, group in self.groups:
            size = dist.get_world_size(group)
            gathered = [torch.empty_like(mine) for _ in range(size)]
            call(dist.all_gather, gathered, mine, group=group)
            if all(torch.equal(other, gathered[0]) for other in gathered):
                continue
            every = all_gather_object(digests, group, self.device)
            raise RuntimeError(_message(type(module).__name__, axis, dist.get_process_group_ranks(group), every))
        return None

    def __deepcopy__(self, memo: dict) -> InputCheck:
        return self


def _message(model: str, axis: str, ranks: Sequence[int], every: Sequence[Mapping[str, tuple[str, int]]]) -> str:
    first = every[0]
    lines = []
    for index in range(1, len(every)):
        other = every[index]
        names = sorted(name for name in {*first, *other} if first.get(name) != other.get(name))
        if names:
            lines.append(f"  rank {ranks[index]} vs rank {ranks[0]}: {', '.join(names)} differ")
    return (
        f"hpgen: the ranks of axis {axis!r} (global ranks {', '.join(map(str, ranks))}) were given different inputs "
        f"to {model}.forward:\n" + "\n".join(lines) + "\nEvery rank of a tensor-parallel group computes part of the "
        "same batch, so each must be given the same one: shard the data over the data-parallel ranks only (e.g. "
        "DistributedSampler(dataset, num_replicas=<dp size>, rank=<dp rank>), not over the whole world). Inputs meant "
        "to differ across these ranks: parallelize(..., check_inputs=False), or check_inputs=(<the other axes>,)."
    )
