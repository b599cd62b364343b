"""Loading a ``torch.distributed.checkpoint`` folder with its files checked before any tensor is touched.

``dcp.load(state, checkpoint_id=folder)`` reads one ``.distcp`` file after another straight
into the state dict's tensors, which for ``model.state_dict()`` are views of the
parameters: when a file is missing or cut short, the load fails after the files before it
were copied in, and the model is part checkpoint, part what it was. With
``storage_reader=checked_reader(folder)`` every file the checkpoint's metadata names is
checked first (there, and long enough for every item the metadata places in it: a stat
per file, nothing read), and a problem fails the load on every rank (DCP gathers the
planning errors of all ranks) before anything is read.
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

from hpgen.runtime.errors import ParallelizeError

__all__ = ["CheckedReader", "checked_reader", "missing_or_short_files"]


def missing_or_short_files(folder: str | os.PathLike[str], storage_data: dict[Any, Any]) -> list[str]:
    """Each file of ``storage_data`` (DCP's index -> file, offset, length) that is absent or too short, in words."""
    needed: dict[str, int] = {}
    for info in storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        path = os.path.join(os.fspath(folder), name)
        try:
            found = os.stat(path).st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if found < size:
            problems.append(f"{name} is truncated ({found} bytes; the metadata needs {size})")
    return problems


class CheckedReader(FileSystemReader):
    """torch's ``FileSystemReader`` that refuses, while planning, a checkpoint whose files are missing or short."""

    def prepare_local_plan(self, plan: Any) -> Any:
        problems = missing_or_short_files(self.path, self.storage_data)
        if problems:
            raise ParallelizeError(
                f"the DCP checkpoint {self.path} cannot be loaded, nothing was read: {'; '.join(problems)}"
            )
        return super().prepare_local_plan(plan)


def checked_reader(checkpoint_id: str | os.PathLike[str]) -> CheckedReader:
    """A storage reader for ``dcp.load(state, storage_reader=checked_reader(folder))`` (see the module docstring)."""
    return CheckedReader(checkpoint_id)
