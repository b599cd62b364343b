"""State-dict entries of hpgen-sharded parameters that FSDP2 has sharded again over ``dp``.

``fully_shard`` after ``parallelize`` makes each parameter a DTensor over the ``dp`` mesh
whose global shape is hpgen's *tp-local* shape (FSDP2 chunks dim ``f``, 0 by default, of
the local tensor it was given). DCP would take that shape for the full one, so the state
dict instead presents a DTensor over the 2-D mesh (``dp``, plan axes) with the global
shape, as torch's own FSDP2 over DTensor-TP does (``_fsdp_param.py``): FSDP2's placement
goes first, as ``_StridedShard(f, split_factor=s)`` when the plan's axes already split
dim ``f`` into ``s`` shards (sharded right to left), else ``Shard(f)``, followed by the
plan's DTensor placements. :func:`composed_form` checks, for every mesh coordinate, that
DTensor's reading of those placements holds exactly the elements FSDP2 holds, and
otherwise says why; the state dict then refuses rather than save wrong data.

Loading goes the other way: :func:`fsdp_value` turns a DTensor of this layout, of any
other layout, or a full tensor into FSDP2's own ``dp`` DTensor of this rank's piece, which
``load_state_dict`` copies into the parameter.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement as DPlacement
from torch.distributed.tensor.placement_types import _StridedShard

from hpgen.runtime.checkpoint.sharded_param import ShardedParam
from hpgen.runtime.errors import ParallelizeError
from hpgen.runtime.shard_layout import PackedShard
from hpgen.core.shards import chunk_bounds, split_sizes


__all__ = ["composed_dtensor", "composed_form", "fsdp_shard_dim", "fsdp_value", "is_fsdp_shard"]


def is_fsdp_shard(value: Any, record: ShardedParam) -> bool:
    """``value`` is FSDP2's DTensor of hpgen's local shard: over another mesh, of the tp-local shape."""
    return (
        isinstance(value, DTensor)
        and tuple(value.shape) == record.local_shape
        and record.local_shape != record.global_shape
    )


def fsdp_shard_dim(value: DTensor, record: ShardedParam) -> int:
    """The dim FSDP2 shards (its 1-D mesh, one ``Shard``), or a clear refusal."""
    placements = tuple(value.placements)
    if value.device_mesh.ndim != 1 or len(placements) != 1:
        raise ParallelizeError(
            f"state_dict(): {record.name} is a DTensor over {value.device_mesh.ndim} mesh dims "
            f"{placements} on top of its {', '.join(record.axes)} shard; only fully_shard on one "
            "dp mesh dim (FSDP2, Shard) composes with hpgen's state dict (HSDP does not yet)"
        )
    (placement,) = placements
    if isinstance(placement, Replicate):
        return -1  # every dp rank holds the whole tp-local shard
    if type(placement) is not Shard:
        raise ParallelizeError(f"state_dict(): {record.name}: FSDP2 placement {placement} is not a Shard")
    return placement.dim


def _indices(n: int, placements: Sequence[DPlacement], sizes: Sequence[int], coordinate: Sequence[int]) -> list[int]:
    """DTensor's global indices of a dim of ``n`` at ``coordinate``: torch's own split, mesh dims left to right.

    ``placements`` are this dim's (``Shard(0)``/``_StridedShard(0, sf)`` or ``Replicate()``).
    """
    index = torch.arange(n)
    for placement, size, rank in zip(placements, sizes, coordinate):
        if isinstance(placement, (Shard, _StridedShard)):
            index = placement._split_tensor(index, size, with_padding=False)[0][rank]
    return index.tolist()


@functools.lru_cache(maxsize=4096)
def composed_form(
    shape: tuple[int, ...], tp: tuple[DPlacement, ...], tp_sizes: tuple[int, ...], dim: int, dp: int, packed: bool
) -> tuple[tuple[DPlacement, ...] | None, str | None]:
    """(placements over (dp, *plan mesh dims), None), or (None, why not), for FSDP2 on ``dim`` over ``dp`` ranks.

    ``tp`` are the plan's exact DTensor placements over mesh dims of ``tp_sizes``. Pure
    function of shapes: every rank reaches the same verdict.
    """
    on_dim = [type(p) is Shard and p.dim == dim for p in tp]
    if any(isinstance(p, _StridedShard) and p.dim == dim for p in tp):
        return None, f"dim {dim} is both packed (SS) by the plan and sharded by FSDP2"
    split = math.prod(size for size, sharded in zip(tp_sizes, on_dim) if sharded)
    if packed and split > 1:
        return None, f"a packed (SS) parameter whose dim {dim} the plan also shards"
    first: DPlacement = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    placements = (first, *tp)
    n = shape[dim]
    dim_tp = [Shard(0) if sharded else Replicate() for sharded in on_dim]
    dim_all = [_StridedShard(0, split_factor=split) if split > 1 else Shard(0), *dim_tp]
    for coordinate in itertools.product(range(dp), *(range(s) for s in tp_sizes)):
        local = _indices(n, dim_tp, tp_sizes, coordinate[1:])  # hpgen's tp-local rows (its form is exact)
        lo, hi = chunk_bounds(len(local), dp, coordinate[0])
        ours = local[lo:hi]  # FSDP2's piece of them
        theirs = _indices(n, dim_all, (dp, *tp_sizes), coordinate)
        if ours != theirs:
            return None, (
                f"dim {dim} of size {n}: FSDP2 on {dp} ranks at coordinate {coordinate} holds "
                f"{len(ours)} rows from {ours[:1]}, DTensor's {placements} would read {len(theirs)} from {theirs[:1]}"
            )
        if packed and (hi - lo) != split_sizes(len(local), dp)[coordinate[0]]:
            # PackedShard names its blocks the hpgen way (tensor_split) on every mesh dim
            return None, f"dim {dim} of size {n} splits differently under chunk and tensor_split on {dp} ranks"
    return placements, None


_MESHES: dict[tuple[DeviceMesh, DeviceMesh], DeviceMesh] = {}


def _mesh(dp: DeviceMesh, tp: DeviceMesh) -> DeviceMesh:
    """The (dp, *tp) mesh, made once per pair (in the same order on every rank, as FSDP2 does)."""
    key = (dp, tp)
    if key not in _MESHES:
        concatenate = getattr(DeviceMesh, "_concatenate", None)
        if concatenate is None:
            raise ParallelizeError(
                "state_dict() of an FSDP2 x hpgen model needs DeviceMesh._concatenate, which this torch lacks"
            )
        _MESHES[key] = concatenate([dp, tp])
    return _MESHES[key]


def _form(record: ShardedParam, value: DTensor) -> tuple[int, DeviceMesh, tuple[DPlacement, ...]]:
    """FSDP2's dim, the composed mesh and placements of ``record`` under ``value``'s FSDP2 sharding."""
    form = record.form
    if form.placements is None or not form.exact or record.mesh is None:
        raise ParallelizeError(
            f"state_dict(): {record.name} under FSDP2: its {', '.join(record.axes)} shard has no exact "
            f"DTensor form ({form.problem}), so its FSDP2 pieces cannot be named either"
        )
    dim = fsdp_shard_dim(value, record)
    if dim < 0:
        return dim, record.mesh, tuple(form.placements)
    tp_sizes = tuple(record.mesh.shape)
    placements, problem = composed_form(
        record.global_shape, tuple(form.placements), tp_sizes, dim, value.device_mesh.size(), form.packed
    )
    if placements is None:
        raise ParallelizeError(
            f"state_dict(): {record.name} (FSDP2 Shard({dim}) over {value.device_mesh.size()} ranks on top of "
            f"{form.placements}): DTensor cannot describe its pieces: {problem}"
        )
    return dim, _mesh(value.device_mesh, record.mesh), placements


def composed_dtensor(record: ShardedParam, value: DTensor) -> DTensor:
    """FSDP2's ``dp`` DTensor of hpgen's shard as a DTensor of the global shape over (dp, plan axes); a view."""
    dim, mesh, placements = _form(record, value)
    shape = torch.Size(record.global_shape)
    stride = torch.empty(record.global_shape, device="meta").stride()
    out = DTensor.from_local(value.to_local(), mesh, placements, run_check=False, shape=shape, stride=stride)
    if record.form.packed:
        out.__class__ = PackedShard
    return out


def fsdp_value(record: ShardedParam, param: DTensor, value: Any) -> Any:
    """What ``load_state_dict`` should copy into FSDP2's parameter ``param`` (a ``dp`` DTensor) for ``value``."""
    spec = dict(run_check=False, shape=param.shape, stride=param.stride())
    if isinstance(value, DTensor) and value.device_mesh == param.device_mesh and value.placements == param.placements:
        return value  # FSDP2's own form
    if isinstance(value, DTensor) and tuple(value.shape) == record.global_shape:
        dim, mesh, placements = _form(record, param)
        if value.device_mesh == mesh and tuple(value.placements) == placements:
            return DTensor.from_local(value.to_local(), param.device_mesh, param.placements, **spec)
    local = record.to_local(value)  # hpgen's tp-local shard (any other DTensor: gathered first)
    if not isinstance(local, Tensor) or tuple(local.shape) != record.local_shape:
        return value  # a size load_state_dict reports
    return DTensor.from_local(dp_piece(local, param), param.device_mesh, param.placements, **spec)


def dp_piece(tensor: Tensor, param: DTensor) -> Tensor:
    """This rank's FSDP2 piece of ``tensor`` (of ``param``'s global shape): ``torch.chunk`` on its Shard dim."""
    (placement,) = param.placements
    if not isinstance(placement, Shard):
        return tensor
    size, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
    lo, hi = chunk_bounds(tensor.size(placement.dim), size, rank)
    return tensor.narrow(placement.dim, lo, hi - lo)
