"""State dicts of a parallelized model that keep every shard: DTensors out, DTensors or full tensors in.

``parallelize`` leaves each sharded parameter a plain ``nn.Parameter`` holding the local
chunk, which is what the generated ``forward`` wants. A plain tensor in a state dict,
though, reads as *replicated* to ``torch.distributed.checkpoint`` (it keeps one rank's
copy) and as the wrong size to an unsharded model. So :func:`install_state_dict_hooks`
registers, on each module owning a sharded parameter:

- a ``state_dict`` post-hook that presents the entry as a DTensor over the plan's axes
  with the global shape and the plan's placements (:mod:`hpgen.runtime.shard_layout`),
  a view of the parameter (no copy); an ``SS`` shard, which is several blocks of the full
  tensor, is a :class:`PackedShard` DTensor that tells DCP about each block;
- a ``load_state_dict`` pre-hook that turns an incoming DTensor (this layout: its local
  tensor; any other: its full tensor) or full unsharded tensor into this rank's chunk,
  which ``load_state_dict`` then copies into the parameter.

Where DTensor's placements cannot describe hpgen's shard exactly (an uneven ``S(d)``
split on more than 2 ranks, where ``tensor_split`` and ``chunk`` differ), the entry is a
copy laid out DTensor's way, made with a gather over the plan's axes: ``state_dict()``
is then collective for that parameter (every rank calls it, as DCP does).

Each record is a :class:`~hpgen.runtime.checkpoint.sharded_param.ShardedParam`, whose
:func:`~hpgen.runtime.checkpoint.sharded_param.gather_full` rebuilds the full tensor of a
parameter from its shards (collective on the plan's axes); ``save_pretrained`` uses it.
``with local_state_dict():`` turns the post-hook off and gives the plain local shards.

Under FSDP2 (``fully_shard`` on ``dp`` after ``parallelize``) a parameter is FSDP2's
``dp`` DTensor of the local shard; :mod:`hpgen.runtime.checkpoint.fsdp_state` presents it over
(``dp``, plan axes) with the global shape and loads values back into FSDP2's pieces.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hpgen.runtime.checkpoint.fsdp_state import composed_dtensor, dp_piece, fsdp_value, is_fsdp_shard
from hpgen.runtime.checkpoint.sharded_param import ShardedParam, gather_full, layout_text
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.forward.collectives import AxisCollectives
from hpgen.runtime.shard_layout import PackedShard, dtensor_form
from hpgen.core.shards import ShardLayout

__all__ = [
    "PackedShard",
    "ShardRecorder",
    "install_state_dict_hooks",
    "load_optimizer_state_dict",
    "local_state_dict",
    "optimizer_state_dict",
    "sharded_params",
]

logger = logging.getLogger("hpgen.runtime")

_LOCAL = contextvars.ContextVar("hpgen_local_state_dict", default=False)


@contextlib.contextmanager
def local_state_dict() -> Iterator[None]:
    """Within this block ``state_dict()`` gives each rank's local shards as plain tensors."""
    token = _LOCAL.set(True)
    try:
        yield
    finally:
        _LOCAL.reset(token)


# --------------------------------------------------------------------------- hooks


def _state_dict_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    if _LOCAL.get():
        return
    for attr, param in module._hp_sharded.items():
        key = prefix + attr
        if key not in state_dict:
            continue
        if param.gathered and not isinstance(state_dict[key], DTensor):
            state_dict[key] = gather_full(state_dict[key].detach(), param)
        elif not isinstance(state_dict[key], DTensor):
            state_dict[key] = param.to_dtensor(state_dict[key])
        elif is_fsdp_shard(state_dict[key], param):  # FSDP2's dp DTensor of the tp-local shard
            state_dict[key] = composed_dtensor(param, state_dict[key])


def _load_pre_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    sharded = getattr(module, "_hp_sharded", {})
    for attr in list(module._parameters) + list(module._buffers):
        key = prefix + attr
        if key not in state_dict:
            continue
        current = module._parameters.get(attr)
        fsdp = isinstance(current, DTensor)  # FSDP2 has made it a dp DTensor
        if attr in sharded:
            record = sharded[attr]
            value = state_dict[key]
            state_dict[key] = fsdp_value(record, current, value) if fsdp else record.to_local(value)
            if _misshapen(state_dict[key], current):
                # torch would compare it with the local shard and call that "the shape in current model"
                error_msgs.append(_size_mismatch(key, value, record))
                del state_dict[key]
                module.__dict__.setdefault("_hp_rejected", set()).add(key)  # not "missing": _drop_rejected
        elif fsdp:
            state_dict[key] = _into_fsdp(current, state_dict[key])
        elif isinstance(state_dict[key], DTensor):
            state_dict[key] = state_dict[key].full_tensor()  # sharded elsewhere, replicated here


def _misshapen(value: Any, current: Any) -> bool:
    return isinstance(value, Tensor) and current is not None and tuple(value.shape) != tuple(current.shape)


def _size_mismatch(key: str, value: Any, record: ShardedParam) -> str:
    """torch's words for a size mismatch, with the parameter's full shape and this rank's part of it."""
    return (
        f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, the "
        f"parameter's full shape is {record.global_shape} (this rank holds {record.local_shape} of it: "
        f"{layout_text(record)})"
    )


def _drop_rejected(module: nn.Module, incompatible_keys: Any) -> None:
    """A load post-hook: keys refused as misshapen were reported as such, not as missing."""
    rejected = module.__dict__.pop("_hp_rejected", set())
    for key in rejected:
        while key in incompatible_keys.missing_keys:
            incompatible_keys.missing_keys.remove(key)


def _into_fsdp(param: DTensor, value: Any) -> Any:
    """A replicated parameter's ``value`` as FSDP2's DTensor ``param`` holds it (its form kept; others gathered)."""
    if isinstance(value, DTensor):
        if value.device_mesh == param.device_mesh and value.placements == param.placements:
            return value
        value = value.full_tensor()
    if not isinstance(value, Tensor) or value.shape != param.shape:
        return value  # a size load_state_dict reports
    spec = dict(run_check=False, shape=param.shape, stride=param.stride())
    return DTensor.from_local(dp_piece(value, param), param.device_mesh, param.placements, **spec)


def install_state_dict_hooks(
    model: nn.Module,
    sharded: Iterable[tuple[Sequence[tuple[nn.Module, str]], str, ShardLayout]],
    mesh: DeviceMesh,
    axes: Mapping[str, AxisCollectives],
    names: Sequence[str],
) -> ShardRecorder:
    """Record each sharded parameter's layout on its owners and register the hooks (see the module docstring).

    ``sharded``: each planned parameter's (module, attribute) owners, one of its names (for
    messages) and this rank's shard of it; ``names`` the plan's axes in mesh order. Returns
    the recorder, which records parameters made later (peft's adapters) the same way.
    """
    recorder = ShardRecorder(mesh, axes, names)
    for owners, name, shard_layout in sharded:
        recorder.record(owners, name, shard_layout)
    recorder.hook_loading(model)
    return recorder


class ShardRecorder:
    """Makes the :class:`ShardedParam` of a parameter and registers the state-dict hooks of its owners."""

    generation = 0  # counts the records made: what caches layouts (clip_grad_norm_'s) checks

    def __init__(self, mesh: DeviceMesh, axes: Mapping[str, AxisCollectives], names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.groups = tuple(axes[axis].group for axis in self.names)
        self.sizes = {axis: axes[axis].size for axis in self.names}
        # toggle axes and a pipeline axis (each stage holds whole modules) are size one: group None
        self.on_mesh = tuple(
            axis for axis in self.names if axis in (mesh.mesh_dim_names or ()) and axes[axis].group is not None
        )
        self.meshes = _Meshes(mesh, self.on_mesh)

    def record(
        self,
        owners: Iterable[tuple[nn.Module, str]],
        name: str,
        shard_layout: ShardLayout,
        *,
        gathered: bool = False,
    ) -> ShardedParam | None:
        """Record the parameter held as ``shard_layout`` under each (owner, attribute); None if whole."""
        shape = shard_layout.shape
        if shard_layout.local_shape == shape:
            return None  # whole on every rank (R, or split over axes of one rank)
        layout = tuple(p for p, axis in zip(shard_layout.placements, self.names) if axis in self.on_mesh)
        form = dtensor_form(shape, layout, tuple(self.sizes[axis] for axis in self.on_mesh))
        dtensor_mesh = self.meshes.get(form.split) if form.placements is not None else None
        if not form.exact and form.placements is not None and not gathered:
            logger.debug("%s: state_dict() copies it DTensor's way: %s", name, form.problem)
        record = ShardedParam(name, shard_layout, self.names, dtensor_mesh, self.groups, form, gathered)
        ShardRecorder.generation += 1
        for owner, attr in owners:
            registry = owner.__dict__.get("_hp_sharded")
            if registry is None:
                registry = owner._hp_sharded = {}
                owner.register_state_dict_post_hook(_state_dict_post_hook)
            registry[attr] = record
        return record

    @staticmethod
    def hook_loading(model: nn.Module) -> None:
        """Give every module of ``model`` with tensors the ``load_state_dict`` pre- and post-hooks (once)."""
        for module in model.modules():
            if (module._parameters or module._buffers) and not module.__dict__.get("_hp_load_hook"):
                module.register_load_state_dict_pre_hook(_load_pre_hook)
                module.register_load_state_dict_post_hook(_drop_rejected)
                module._hp_load_hook = True


class _Meshes:
    """The DeviceMesh of each DTensor form: the plan's axes, ``RS`` axes unflattened into chunks x replicas.

    Unflattening makes process groups (a collective), so each mesh is made once, in the
    same order on every rank (the plan is the same everywhere).
    """

    def __init__(self, mesh: DeviceMesh, axes: tuple[str, ...]) -> None:
        names = tuple(mesh.mesh_dim_names or ())
        # no axis on the mesh (a pipeline-only plan): nothing is sharded, no DTensor is made
        self.base = mesh if names == axes or not axes else mesh[axes if len(axes) > 1 else axes[0]]
        self.axes = axes
        self.made: dict[tuple[int | None, ...], DeviceMesh] = {}

    def get(self, split: tuple[int | None, ...]) -> DeviceMesh:
        if not any(split):
            return self.base
        if split not in self.made:
            mesh = self.base
            for axis, replicas in zip(self.axes, split):
                if replicas is not None:
                    size = mesh.size(mesh.mesh_dim_names.index(axis))
                    parts = (f"{axis}_chunks_of_{replicas}", f"{axis}_replicas_of_{replicas}")
                    if not hasattr(mesh, "_unflatten"):  # torch < 2.9
                        raise ParallelizeError(
                            f"state_dict() of RS({replicas}) parameters on axis {axis!r} needs "
                            "DeviceMesh._unflatten (torch 2.9 or newer)"
                        )
                    mesh = mesh._unflatten(axis, (size // replicas, replicas), parts)
            self.made[split] = mesh
        return self.made[split]


def sharded_params(model: nn.Module) -> dict[str, ShardedParam]:
    """FQN -> :class:`ShardedParam` for every sharded parameter name of ``model`` (tied ones under each name)."""
    found = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, record in module.__dict__.get("_hp_sharded", {}).items():
            found[f"{prefix}.{attr}" if prefix else attr] = record
    return found


# --------------------------------------------------------------------------- optimizer state


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter FQN, each sharded parameter's state (``exp_avg``, ...) a DTensor.

    torch's ``get_optimizer_state_dict``, with every state tensor of a sharded parameter's
    local shape given that parameter's DTensor form, so that DCP saves all its shards
    (plain tensors would read as replicated) and can load them at another layout. Under
    FSDP2 (``fully_shard`` on ``dp`` after ``parallelize``) a state tensor is FSDP2's ``dp``
    DTensor of the local shard, presented over (``dp``, plan axes) with the global shape,
    exactly as the parameter is in ``model.state_dict()``.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)
    records = sharded_params(model)
    for fqn, per_param in state.get("state", {}).items():
        record = records.get(fqn)
        if record is None:
            continue
        # a new dict: the inner ones are the optimizer's own state
        state["state"][fqn] = {name: _presented(value, record) for name, value in per_param.items()}
    return state


def _presented(value: Any, record: ShardedParam) -> Any:
    """An optimizer state tensor of a sharded parameter in the parameter's state-dict form; others as they are."""
    if _is_local_state(value, record):
        return record.to_dtensor(value)
    if is_fsdp_shard(value, record):
        return composed_dtensor(record, value)
    return value


def _is_local_state(value: Any, record: ShardedParam) -> bool:
    """A plain tensor of the parameter's local shape (``exp_avg``); not a scalar such as ``step``."""
    return isinstance(value, Tensor) and not isinstance(value, DTensor) and tuple(value.shape) == record.local_shape


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load an FQN-keyed optimizer state (this layout's DTensors, another's, or full tensors) into ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    records = sharded_params(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    local: dict[str, Any] = dict(state)
    local["state"] = {}
    for fqn, per_param in state.get("state", {}).items():
        record, param = records.get(fqn), params.get(fqn)
        converted = {}
        for name, value in per_param.items():
            if not isinstance(value, Tensor) or value.ndim == 0:
                pass  # ``step`` and other scalars: as they are
            elif record is not None and isinstance(param, DTensor):  # FSDP2 over hpgen's shard
                value = fsdp_value(record, param, value)
            elif record is not None:
                value = record.to_local(value)
            elif isinstance(param, DTensor):  # replicated by hpgen, sharded by FSDP2
                value = _into_fsdp(param, value)
            elif isinstance(value, DTensor):
                value = value.full_tensor()
            converted[name] = value
        local["state"][fqn] = converted
    set_optimizer_state_dict(model, optimizer, local)
