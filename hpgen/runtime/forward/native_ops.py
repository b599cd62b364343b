"""Which native single-tensor collectives a process group's backend runs: found by a probe, not by an error's text.

The eager ops use ``torch.distributed``'s single-tensor collectives (``all_gather_single``,
``reduce_scatter_single``, ``all_to_all_single``) where the axis's backend has them, and fall
back to the list forms every backend has where it does not
(:mod:`~hpgen.runtime.forward.collectives`). torch offers no way to ask which ops a backend
implements: the table in torch.distributed's documentation is prose, a backend object's
``supports_*`` speak of splitting, coalescing, shrinking and time estimates only, and a refusal
has no exception type of its own. c10d's ``Backend`` base class raises a plain ``RuntimeError``
("Backend <name> does not support <op>"), and a third-party ``ProcessGroup`` registered with
``Backend.register_backend`` that lacks the op raises another ("No backend type associated with
device type cpu", torch 2.13): an error's text is no contract, so none is read.

Instead each axis runs an op once on tiny tensors (:class:`NativeOps`): ``parallelize`` has it
try all three on the model's collective device at install
(:meth:`~hpgen.runtime.forward.collectives.AxisCollectives.find_native_ops`), so that no try
runs inside a forward, and another device type is tried the first time it needs that op. A try
sends one element from each rank, with the real call's device, dtype and number of dims, shapes
right by construction. If the probe raises, whatever the error, the backend lacks the op for
that axis and device: nothing was sent, and the fallback runs from then on. Every rank of the
group decides alike and none waits for another: a refusal is raised before any communication, by
code that knows nothing of the rank, and a probe that runs is a collective that every rank of
the group reaches at the same point (the install, or its first call of that op on that device;
every rank calls an axis's ops in the same order). The answer is kept per axis, so each group's
ranks probe together. Nothing is hidden: a probe's inputs cannot be wrong, a group that fails
for another reason fails again in the fallback, and the real calls run unguarded, their errors
reaching the caller. ``tests/runtime/forward/test_collectives.py`` runs every op on a backend
registered with the installed torch that lacks all three, and on gloo, which has them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor

from .handback import call

__all__ = ["NativeOps"]


def _probe_arguments(name: str, like: Tensor, size: int) -> tuple[object, ...]:
    """Tiny, well-formed arguments of the single-tensor collective ``name`` over ``size`` ranks: one element from
    each rank, in tensors of ``like``'s device, dtype and number of dims (blocks stacked on the first)."""
    ones = (1,) * (like.dim() - 1)
    one, every = like.new_zeros((1, *ones)), like.new_zeros((size, *ones))
    if "all_to_all" in name:
        return every, like.new_zeros((size, *ones)), [1] * size, [1] * size
    if "gather" in name:  # all_gather_single (all_gather_into_tensor on older torch): out, in
        return every, one
    if "scatter" in name:  # reduce_scatter_single (reduce_scatter_tensor): out, in
        return one, every
    raise ValueError(f"no probe for the collective {name!r}")


class NativeOps:
    """The native single-tensor collectives one axis's group runs, per device type: probed at first use."""

    def __init__(self, group: dist.ProcessGroup | None, size: int) -> None:
        self.group = group
        self.size = size
        self.found: dict[tuple[str, str], bool] = {}  # (device type, collective's name) -> runs natively

    def runs(self, collective: Callable[..., object], like: Tensor) -> bool:
        """Whether this group's backend runs ``collective`` on tensors like ``like``; probed the first time."""
        key = (like.device.type, collective.__name__)
        if key not in self.found:
            try:
                call(collective, *_probe_arguments(key[1], like, self.size), group=self.group)
            except Exception:  # the backend's refusal, whatever its type and text (see the module docstring)
                self.found[key] = False
            else:
                self.found[key] = True
        return self.found[key]

    def lacking(self) -> set[tuple[str, str]]:
        """The (device type, collective) pairs found to fall back."""
        return {key for key, runs in self.found.items() if not runs}
