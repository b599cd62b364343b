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

:func:`gather_full` rebuilds the full tensor of a parameter from its shards (collective on
the plan's axes); ``save_pretrained`` uses it. ``with local_state_dict():`` turns the
post-hook off and gives the plain local shards.

Under FSDP2 (``fully_shard`` on ``dp`` after ``parallelize``) a parameter is FSDP2's
``dp`` DTensor of the local shard; :mod:`hpgen.runtime.checkpoint.fsdp_state` presents it over
(``dp``, plan axes) with the global shape and loads values back into FSDP2's pieces.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from hpgen.runtime.checkpoint.fsdp_state import composed_dtensor, dp_piece, fsdp_value, is_fsdp_shard
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.forward.collectives import AxisCollectives
from hpgen.runtime.forward.handback import call
from hpgen.runtime.install.params import ParamShard
from hpgen.runtime.shard_layout import DTensorForm, PackedShard, dtensor_form
from hpgen.shards import ShardLayout

__all__ = [
    "PackedShard",
    "ShardRecorder",
    "ShardedParam",
    "gather_full",
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


@dataclass(frozen=True, eq=False)
class ShardedParam:
    """A sharded parameter as the state dict sees it: full shape, layout, DTensor form."""

    name: str  # one FQN, for messages
    shard_layout: ShardLayout  # the full shape, and (placement, rank, size) per plan axis in mesh order
    axes: tuple[str, ...]
    mesh: DeviceMesh | None  # the DTensor form's mesh: the plan's axes, RS axes unflattened (None: no form)
    groups: tuple[Any, ...]  # each axis's process group
    form: DTensorForm
    gathered: bool = False  # state_dict() gives the full tensor (peft's adapters), not a DTensor

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.shard_layout.shape

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.shard_layout.local_shape

    def __deepcopy__(self, memo: dict) -> ShardedParam:
        return self  # immutable, holds process groups: shared by copies of a model

    def to_dtensor(self, local: Tensor) -> DTensor:
        """``local`` (this rank's chunk) as a DTensor over the plan's axes.

        A view when the DTensor form is exact; otherwise (``tensor_split`` and ``chunk``
        differ) a copy laid out DTensor's way, which takes a gather over the plan's axes:
        then every rank must call ``state_dict()`` together, as DCP does.
        """
        form = self.form
        if form.placements is None:
            raise ParallelizeError(f"state_dict(): {self.name} ({_layout_text(self)}): {form.problem}")
        shape = torch.Size(self.global_shape)
        stride = torch.empty(self.global_shape, device="meta").stride()
        if not form.exact:
            full = gather_full(local.detach(), self)
            local = distribute_tensor(full, self.mesh, form.chunked, src_data_rank=None).to_local()
            return DTensor.from_local(local, self.mesh, form.chunked, run_check=False, shape=shape, stride=stride)
        dtensor = DTensor.from_local(local, self.mesh, form.placements, run_check=False, shape=shape, stride=stride)
        if form.packed:
            dtensor.__class__ = PackedShard
        return dtensor

    def to_local(self, value: Any) -> Any:
        """What ``load_state_dict`` should copy into the local parameter for ``value``."""
        if isinstance(value, DTensor):
            if (
                self.form.exact
                and tuple(value.shape) == self.global_shape
                and value.device_mesh == self.mesh
                and tuple(value.placements) == self.form.placements
            ):
                return value.to_local()
            value = value.full_tensor()  # another layout: collective over its mesh
        if isinstance(value, Tensor) and tuple(value.shape) == self.global_shape != self.local_shape:
            return self.shard_layout.local_slice(value)
        return value  # the local shape already, or a size load_state_dict reports


def _layout_text(param: ShardedParam) -> str:
    return ", ".join(f"{axis} {p} over {size}" for axis, (p, _, size) in zip(param.axes, param.shard_layout.shares))


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
        f"{_layout_text(record)})"
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
    shards: Iterable[ParamShard],
    mesh: DeviceMesh,
    axes: Mapping[str, AxisCollectives],
    names: Sequence[str],
) -> ShardRecorder:
    """Record each sharded parameter's layout on its owners and register the hooks (see the module docstring).

    ``shards`` are :func:`~hpgen.runtime.install.params.survey_params`'s records, read before
    :func:`~hpgen.runtime.install.params.shard_params` (their ``param`` has the full shape);
    ``names`` the plan's axes in mesh order. Returns the recorder, which records
    parameters made later (peft's adapters) the same way.
    """
    recorder = ShardRecorder(mesh, axes, names)
    for shard in shards:
        recorder.record(shard.owners, shard.names[0], shard.shard_layout)
    recorder.hook_loading(model)
    return recorder


class ShardRecorder:
    """Makes the :class:`ShardedParam` of a parameter and registers the state-dict hooks of its owners."""

    generation = 0  # counts the records made: what caches layouts (clip_grad_norm_'s) checks

    def __init__(self, mesh: DeviceMesh, axes: Mapping[str, AxisCollectives], names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.groups = tuple(axes[axis].group for axis in self.names)
        self.sizes = {axis: axes[axis].size for axis in self.names}
        self.on_mesh = tuple(axis for axis in self.names if axis in (mesh.mesh_dim_names or ()))  # toggle axes: size 1
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
        self.base = mesh if names == axes else mesh[axes if len(axes) > 1 else axes[0]]
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


# --------------------------------------------------------------------------- gathering


def gather_full(local: Tensor, param: ShardedParam) -> Tensor:
    """The full tensor of ``param`` from every rank's ``local`` shard (all ranks of the plan's axes call it).

    Undoes the axes in reverse mesh order: on each, an all-gather of the (padded) pieces,
    each put back where :meth:`ShardLayout.pieces` says it came from (one range for ``S``,
    one per block for ``SS``; of the ``r`` equal pieces of an ``RS(d,r)`` chunk, the first).
    """
    layout = param.shard_layout
    tensor = local.contiguous()
    for axis in reversed(range(len(layout.shares))):
        placement, _, size = layout.shares[axis]
        if placement.is_replicate or size == 1:
            continue
        try:
            dim = layout.split_dim(axis)
            ranges = layout.pieces(axis)
        except ValueError as error:
            raise ParallelizeError(f"{param.name}: cannot gather: {error}") from None
        sizes = [sum(stop - start for start, stop in runs) for runs in ranges]
        pieces = _all_gather_uneven(tensor, dim, sizes, param.groups[axis])
        shape = list(tensor.shape)
        shape[dim] = layout.prefix(axis).local_shape[dim]
        tensor = tensor.new_empty(shape)
        placed: set[tuple[tuple[int, int], ...]] = set()
        for piece, runs in zip(pieces, ranges):
            if tuple(runs) in placed:
                continue  # a replica of a piece already in place (RS)
            placed.add(tuple(runs))
            position = 0
            for start, stop in runs:
                tensor.narrow(dim, start, stop - start).copy_(piece.narrow(dim, position, stop - start))
                position += stop - start
    return tensor


def _all_gather_uneven(tensor: Tensor, dim: int, sizes: Sequence[int], group: Any) -> list[Tensor]:
    """Every rank's ``tensor`` (``sizes[r]`` long on ``dim``), padded to the longest for the collective."""
    longest = max(sizes)
    padded = tensor
    if tensor.size(dim) < longest:
        shape = list(tensor.shape)
        shape[dim] = longest - tensor.size(dim)
        padded = torch.cat([tensor, tensor.new_zeros(shape)], dim)
    gathered = [torch.empty_like(padded) for _ in sizes]
    call(dist.all_gather, gathered, padded.contiguous(), group=group)
    return [piece.narrow(dim, 0, n) for piece, n in zip(gathered, sizes)]
