"""``save_pretrained`` of a parallelized model: the unsharded transformers checkpoint, one writer, crash-safe.

Every rank takes part in rebuilding each sharded parameter's full tensor
(:func:`hpgen.runtime.checkpoint.sharded_param.gather_full`, one tensor in flight); the writer (rank 0,
when ``is_main_process`` there, as transformers decides) keeps them on the CPU and writes
the checkpoint with transformers' own ``save_pretrained`` (config, generation config,
safetensors shards, tied weights dropped, conversions reverted to the checkpoint layout
transformers uses, e.g. per-expert MoE weights) into a sibling temporary folder, which
then replaces the target in one step (:mod:`hpgen.runtime.checkpoint.folder_swap`): at every
instant the folder holds the complete old or the complete new checkpoint. The other
ranks wait for it and raise the writer's error if it had one, so the call ends the same
way everywhere.

``parallelize`` binds :func:`save_pretrained` as the model's ``save_pretrained`` method.
"""

from __future__ import annotations

import os
import re
import shutil
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hpgen.runtime.checkpoint.conversions import model_conversions
from hpgen.runtime.checkpoint.sharded_param import gather_full
from hpgen.runtime.checkpoint.state_dict import local_state_dict, sharded_params
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.checkpoint.folder_swap import replacing
from hpgen.runtime.forward.handback import all_gather_object, broadcast_object

__all__ = ["bind_save_pretrained", "full_state_dict", "save_pretrained", "write_checkpoint"]

# The weight files a transformers save writes (any variant, shards and their index): an old
# folder's are replaced as a whole by the new save's, never kept beside them.
WEIGHT_FILE = re.compile(r"(model|adapter_model|pytorch_model)(\.[^.]+)?(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, keep: bool | None = None) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on the CPU; every rank of the mesh calls it (and of ``dp`` under FSDP2).

    With ``rank0_only`` the other ranks get an empty dict (they still send their shards);
    ``keep``, when given, says for this rank instead.
    """
    if keep is None:
        keep = _rank() == 0 or not rank0_only
    staged = model.__dict__.get("_hp_stage")  # pipeline stages: each rank's stages whole, then exchanged
    keep_whole, keep = keep, keep or staged is not None
    records = sharded_params(model)
    with local_state_dict():
        local = model.state_dict()
    full: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}  # one gather per Parameter, shared by its tied names
    for key, value in local.items():
        record = records.get(key)
        if record is not None and id(record) in done:
            tensor = done[id(record)]
        else:
            # FSDP2 (fully_shard on dp after parallelize): its dp pieces first, then hpgen's axes
            tensor = value.full_tensor() if isinstance(value, DTensor) else value
            if record is not None:
                tensor = gather_full(tensor, record)
                done[id(record)] = tensor
        if keep:
            full[key] = _on_cpu(tensor)
    if staged is not None:
        from hpgen.runtime.pipeline.gather import gather_stages

        return gather_stages(staged, full, keep_whole)
    return full


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu() if tensor.device.type != "cpu" else tensor.detach()


def _given_state_dict(state_dict: Mapping[str, Any], keep: bool) -> dict[str, torch.Tensor]:
    """A state dict the caller passed: DTensors (``model.state_dict()``) made full (collective), in key order."""
    full = {}
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            full[key] = _on_cpu(value) if isinstance(value, torch.Tensor) else value
    return full


def save_pretrained(
    model: nn.Module,
    save_directory: str | os.PathLike[str],
    is_main_process: bool = True,
    state_dict: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> None:
    """Write ``model``'s unsharded checkpoint to ``save_directory`` (every rank calls it; one writes).

    transformers' keywords keep their meaning: the writer is rank 0 when its
    ``is_main_process`` is true (transformers' rule; every rank still joins the gather),
    ``state_dict`` replaces the model's (DTensors in it are gathered: then every rank passes
    one), and the rest (``max_shard_size``, ``variant``, ``safe_serialization``,
    ``push_to_hub``, ...) go to transformers' ``save_pretrained``. Files of the old folder
    that the save does not write (a tokenizer, a README) are kept; its old weight files are
    not. On a write error every rank raises it.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ParallelizeError(f"save_pretrained: {type(model).__name__} is not a transformers PreTrainedModel")
    if kwargs.get("distributed_checkpoint"):
        raise ParallelizeError(
            "save_pretrained(distributed_checkpoint=True) on a parallelized model: save "
            "model.state_dict() with torch.distributed.checkpoint (dcp.save) instead; its DTensors keep every shard"
        )
    _same_on_every_rank(state_dict is not None)
    writer = _rank() == 0 and bool(is_main_process)
    if state_dict is None:
        full = full_state_dict(model, keep=writer)
    else:
        full = _given_state_dict(state_dict, writer)
    error: BaseException | None = None
    if writer:
        try:
            write_checkpoint(model, full, save_directory, **kwargs)
        except Exception as caught:  # every rank raises it below
            error = caught
    del full
    message = _writer_error(error, save_directory)
    if error is not None:
        raise ParallelizeError(message) from error
    if message is not None:
        raise ParallelizeError(f"rank 0 could not write the checkpoint, so this rank stops too: {message}")


def _same_on_every_rank(given: bool) -> None:
    """Refuse, everywhere, a ``state_dict`` passed on some ranks only: their gathers would not pair up."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    flags = all_gather_object(given)
    if len(set(flags)) > 1:
        with_it = [rank for rank, flag in enumerate(flags) if flag]
        raise ParallelizeError(
            f"save_pretrained: ranks {with_it} passed state_dict= and the others did not; pass it on every "
            "rank (its DTensors are gathered by all of them) or on none"
        )


def _writer_error(error: BaseException | None, directory: str | os.PathLike[str]) -> str | None:
    """The writer's error as one message, known to every rank (None: the checkpoint is written)."""
    message = None if error is None else f"save_pretrained({os.fspath(directory)!r}): {type(error).__name__}: {error}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        message = broadcast_object(message, src=0)
    return message


def write_checkpoint(
    model: nn.Module, full: dict[str, torch.Tensor], save_directory: str | os.PathLike[str], **kwargs: Any
) -> None:
    """The writer's half of :func:`save_pretrained`: ``full`` saved by transformers into a new folder swapped in.

    The old folder's files that this save does not write, weight files aside, are hard
    links in the new folder (copies where links are refused), so they survive the swap.
    """
    from transformers import PreTrainedModel

    target = Path(os.path.realpath(save_directory))
    if target.exists() and not target.is_dir():
        raise ParallelizeError(f"{save_directory} is a file, not a folder")
    if kwargs.get("push_to_hub"):
        kwargs.setdefault("repo_id", target.name)  # not the temporary folder's name
    with replacing(target) as staging:
        restore = "_weight_conversions" not in model.__dict__
        if restore:
            # A generated class counts as custom code to transformers, which would then keep the
            # in-memory layout (fused experts); write the layout its own classes write.
            model._weight_conversions = _conversions_for_saving(model)
        try:
            # a copy: transformers pops what it writes from the dict it is given
            PreTrainedModel.save_pretrained(model, staging, state_dict=dict(full), is_main_process=True, **kwargs)
        finally:
            if restore:
                del model._weight_conversions
        if target.is_dir():
            _carry_over(target, staging)


def _carry_over(old: Path, new: Path) -> None:
    """Link into ``new`` what ``old`` holds and this save did not write, except old weight files."""
    for entry in sorted(old.iterdir()):
        if (new / entry.name).exists() or (entry.is_file() and WEIGHT_FILE.fullmatch(entry.name)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, new / entry.name)


def _link_or_copy(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
    if os.path.islink(source):
        os.symlink(os.readlink(source), destination)
        return
    try:
        os.link(source, destination)
    except OSError:  # a file system without hard links, or a limit on them
        shutil.copy2(source, destination)


def _conversions_for_saving(model: nn.Module) -> list[Any] | None:
    """The transforms transformers would revert when saving ``model`` (prefix changes and legacy renames aside)."""
    from transformers.core_model_loading import PrefixChange

    kept = [c for c in model_conversions(model, legacy=False) if not isinstance(c, PrefixChange)]
    return kept or None


def bind_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained(dir)`` write the unsharded checkpoint (see :func:`save_pretrained`)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return
    if isinstance(model, PreTrainedModel):
        model.save_pretrained = types.MethodType(save_pretrained, model)
