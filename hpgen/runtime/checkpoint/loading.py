"""A transformers checkpoint read into a model built on the meta device, each rank reading its slices.

:func:`load_checkpoint` reads each parameter from the safetensors files box by box — only
this rank's rows or columns, or its experts (:mod:`hpgen.runtime.shard_layout`,
:mod:`hpgen.runtime.checkpoint.conversions`) — straight into one tensor of its dtype on
``device`` (a shard that is one run of the file's bytes, in its dtype, on the CPU, is a
view of the file instead: :mod:`hpgen.runtime.checkpoint.checkpoint_files`), and puts it
in place of the meta tensor under all its names (tied weights stay one Parameter). It runs
before any hook is attached to the parameters (``from_pretrained``:
:mod:`hpgen.runtime.install.pretrained`), so a new Parameter needs nothing of the old one.

:func:`initialise_buffers` then allocates the non-persistent buffers (rotary ``inv_freq``,
...) on ``device`` and initialises them the way transformers does after its own meta
build: the model's ``initialize_weights()``, which skips every tensor flagged as loaded
(``_is_hf_initialized``) and so only computes the buffers.

Peak memory per rank: its shards, the replicated parameters, and one tensor in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpgen.runtime.checkpoint.checkpoint_files import CheckpointFiles
from hpgen.runtime.checkpoint.conversions import Mapped, Source, checkpoint_sources, model_conversions
from hpgen.runtime.checkpoint.registrations import registrations
from hpgen.runtime.errors import ParallelizeError
from hpgen.core.shards import ShardLayout

__all__ = ["initialise_buffers", "load_checkpoint"]

logger = logging.getLogger("hpgen.runtime")


def load_checkpoint(
    model: nn.Module,
    files: CheckpointFiles,
    device: torch.device,
    layouts: Mapping[str, ShardLayout],
    *,
    elsewhere: Callable[[str], bool] | None = None,
) -> None:
    """Read every parameter's local shard (and the persistent buffers) into place.

    ``model`` is on the meta device, its planned parameters already of their local shape;
    ``layouts`` gives this rank's shard of each split parameter by FQN (every other tensor
    is read whole). A parameter the checkpoint lacks, or holds with another shape, is a
    :class:`ParallelizeError`. ``elsewhere``: keys of tensors other pipeline stages hold, not reported unused.
    """
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}  # local: no hooks yet
    full_shapes = {key: layouts[key].shape if key in layouts else shape for key, shape in shapes.items()}
    # transformers' rules are only needed when the checkpoint's names are not the model's
    # (building them compiles a regex for every rule of every architecture)
    exact = set(files.keys()) == set(full_shapes)
    sources = checkpoint_sources(model, files, full_shapes, [] if exact else model_conversions(model))
    _report_unexpected(model, [key for key in sources.unexpected if elsewhere is None or not elsewhere(key)])
    dtype_plan = _dtype_plan(model)

    tensors = registrations(model)
    missing = []
    rank = dist.get_rank() if dist.is_initialized() else 0
    progress = _progress(sum(found.persistent for found in tensors), rank)
    for found in tensors:
        if not found.persistent:
            continue
        tensor, names = found.tensor, found.names
        name = next((n for n in names if n in sources.by_key), None)
        if name is None:
            if found.is_param:
                missing.extend(names)
            continue  # a persistent buffer the checkpoint lacks is initialised like the others
        source = sources.by_key[name]
        layout = layouts[name] if name in layouts else ShardLayout(tuple(tensor.shape), ())
        if tuple(source.shape) != layout.shape:
            raise ParallelizeError(
                f"{name}: the checkpoint holds shape {tuple(source.shape)} ({source.described}) but the model's "
                f"parameter is {layout.shape}; is this the checkpoint of this model and config?"
            )
        dtype = _target_dtype(name, tensor, dtype_plan)
        try:
            value = _read_local(source, layout, dtype, device)
        except ValueError as error:
            raise ParallelizeError(f"{name}: {error}") from None
        if tuple(value.shape) != tuple(tensor.shape):  # the layout and the parameter must agree
            raise ParallelizeError(
                f"{name}: read a shard of shape {tuple(value.shape)} for a parameter of {tuple(tensor.shape)}"
            )
        if isinstance(source, Mapped):
            source.release()
        if found.is_param:
            value = nn.Parameter(value, requires_grad=tensor.requires_grad)
        value._is_hf_initialized = True
        for owner, attr in found.owners:
            (owner._parameters if found.is_param else owner._buffers)[attr] = value
        progress.update(1)
    progress.close()
    missing = [name for name in missing if not _ignored(model, name, "_keys_to_ignore_on_load_missing")]
    if missing:
        raise ParallelizeError(
            f"the checkpoint in {files.folder} has no weights for {len(missing)} parameter(s) of "
            f"{type(model).__name__}: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}"
        )
    model._weight_conversions = sources.conversions_used  # what transformers records: save_pretrained reverts them


def _read_local(source: Source, layout: ShardLayout, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's chunk of ``source`` (``layout``'s full shape) in ``dtype`` on ``device``.

    A chunk that is one box of the file, in its dtype, on the CPU, is the file's bytes as
    they are (:meth:`Source.view`); any other is allocated once and each of its boxes read
    straight into its place, cast on the way."""
    parts = layout.boxes()
    whole = len(parts) == 1 and parts[0].local_offsets == (0,) * len(layout.shape)
    if whole and device.type == "cpu":
        view = source.view(parts[0].bounds())
        if view is not None and view.dtype == dtype:
            return view
    out = torch.empty(layout.local_shape, dtype=dtype, device=device)
    for box in parts:
        if all(s > 0 for s in box.sizes):
            source.read_into(box.bounds(), box.local_view(out))
    return out


def initialise_buffers(model: nn.Module, device: torch.device) -> None:
    """Allocate what is still on the meta device (non-persistent buffers) and let transformers fill it."""
    for module in model.modules():
        for attr, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[attr] = torch.empty_like(buffer, device=device)
    for module in model.modules():  # modules with nothing left to compute skip _init_weights, as in transformers
        tensors = [*module._parameters.values(), *module._buffers.values()]
        if tensors and all(t is None or getattr(t, "_is_hf_initialized", False) for t in tensors):
            module._is_hf_initialized = True
    initialize = getattr(model, "initialize_weights", None)
    if initialize is not None:
        initialize()
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ParallelizeError(f"after loading, still on the meta device (nothing initialised them): {', '.join(left)}")


def _target_dtype(name: str, tensor: torch.Tensor, dtype_plan: Mapping[str, Any]) -> torch.dtype:
    for pattern, dtype in dtype_plan.items():
        if pattern in name:
            return dtype
    return tensor.dtype  # built under the load dtype; buffers and deliberate exceptions keep theirs


def _dtype_plan(model: nn.Module) -> dict[str, torch.dtype]:
    """transformers' ``_keep_in_fp32_modules`` choices for this dtype (module-name fragments)."""
    getter = getattr(model, "_get_dtype_plan", None)
    if getter is None:
        return {}
    return dict(getter(getattr(model.config, "dtype", torch.get_default_dtype())))


def _ignored(model: nn.Module, name: str, attribute: str) -> bool:
    import re

    patterns = getattr(model, attribute, None) or ()
    return any(re.search(pattern, name) for pattern in patterns)


def _report_unexpected(model: nn.Module, keys: list[str]) -> None:
    keys = [
        k
        for k in keys
        if not _ignored(model, k, "_keys_to_ignore_on_load_unexpected") and "rotary_emb.inv_freq" not in k
    ]
    if keys and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(
            "from_pretrained: %d checkpoint key(s) are not used by %s: %s",
            len(keys),
            type(model).__name__,
            ", ".join(keys[:10]) + (" ..." if len(keys) > 10 else ""),
        )


def _progress(total: int, rank: int) -> Any:
    """A tqdm bar on rank 0 (transformers' own, which its ``disable_progress_bar`` turns off)."""
    try:
        from transformers.utils import logging as hf_logging

        return hf_logging.tqdm(total=total, desc="Loading weights", disable=rank != 0)
    except ImportError:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="Loading weights", disable=rank != 0)
