"""``save_pretrained`` of a parallelized model: the unsharded transformers checkpoint, one writer.

Every rank takes part in rebuilding each sharded parameter's full tensor
(:func:`hpgen.runtime.state_dict.gather_full`, one tensor in flight); rank 0 keeps them on
the CPU and writes the checkpoint with transformers' own ``save_pretrained`` (config,
generation config, safetensors shards, tied weights dropped, conversions reverted to the
checkpoint layout transformers uses, e.g. per-expert MoE weights). The other ranks wait
for it, so the folder is complete when the call returns anywhere.

``parallelize`` binds :func:`save_pretrained` as the model's ``save_pretrained`` method.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpgen.runtime.conversions import model_conversions
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.state_dict import gather_full, local_state_dict, sharded_params

__all__ = ["bind_save_pretrained", "full_state_dict", "save_pretrained"]


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on the CPU; every rank of the mesh calls it.

    With ``rank0_only`` the other ranks get an empty dict (they still send their shards).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    keep = rank == 0 or not rank0_only
    records = sharded_params(model)
    with local_state_dict():
        local = model.state_dict()
    full: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}  # one gather per Parameter, shared by its tied names
    for key, value in local.items():
        record = records.get(key)
        if record is None:
            tensor = value
        elif id(record) in done:
            tensor = done[id(record)]
        else:
            tensor = gather_full(value, record)
            done[id(record)] = tensor
        if keep:
            full[key] = tensor.detach().cpu() if tensor.device.type != "cpu" else tensor.detach()
    return full


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike[str], **kwargs: Any) -> None:
    """Write ``model``'s unsharded checkpoint to ``save_directory`` (all ranks call it; rank 0 writes).

    ``kwargs`` go to transformers' ``save_pretrained`` (``max_shard_size``,
    ``safe_serialization``, ...); ``state_dict`` and ``is_main_process`` are hpgen's to set.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ParallelizeError(f"save_pretrained: {type(model).__name__} is not a transformers PreTrainedModel")
    for reserved in ("state_dict", "is_main_process"):
        if reserved in kwargs:
            raise TypeError(f"save_pretrained: {reserved!r} is set by hpgen on a parallelized model")
    full = full_state_dict(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        if rank == 0:
            restore = "_weight_conversions" not in model.__dict__
            if restore:
                # A generated class counts as custom code to transformers, which would then keep the
                # in-memory layout (fused experts); write the layout its own classes write.
                model._weight_conversions = _conversions_for_saving(model)
            try:
                PreTrainedModel.save_pretrained(model, save_directory, state_dict=full, is_main_process=True, **kwargs)
            finally:
                if restore:
                    del model._weight_conversions
    finally:
        if dist.is_initialized():
            dist.barrier()


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
