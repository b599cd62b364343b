"""Parameters a linear-attention mixer reads between its projections: the conv and per-head tensors.

Gated-delta-net style mixers (Kimi Linear's KDA, Bailing's linear attention) run a causal
depthwise convolution over ``cat([q, k, v])`` by reading ``self.conv1d.weight`` directly, and
scale each head by a tensor shaped ``[1, 1, heads, 1]`` (``A_log``). Both follow the head
shards exactly:

- a *depthwise* ``nn.Conv1d`` (``groups == in_channels == out_channels``) computes each
  channel from that channel alone, so with ``k`` equal sharded columns concatenated its
  weight ``[k * width, 1, kernel]`` is ``k`` packed blocks, ``SS(0,k)``: each rank keeps its
  chunk of every block, as the local ``cat`` lays its channels out (one block: ``S(0)``);
  a convolution that mixes channels is refused; one over a single column's output
  alone (a short convolution on the keys) is ``S(0)`` (:func:`single_column_conv`);
- a tensor with a single non-1 dim of the query-head count is one value per head:
  ``S(d)`` on that dim.

A bias the layer does not have (``bias=False``: the code reads ``self.conv1d.bias`` as
``None``) is nothing to place.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any
from hpgen.core.placement import Placement, shard, strided_shard

__all__ = ["absent", "conv_placement", "per_head_placement", "single_column_conv"]


def absent(model: Any, name: str) -> bool:
    """Whether ``name`` names an attribute that is ``None`` (a bias the layer was built without)."""
    owner, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    return leaf in getattr(module, "_parameters", {}) and module._parameters[leaf] is None


def conv_placement(model: Any, name: str, param: Any, col_widths: list[int], shapes: Any = ()) -> Placement | None:
    """``SS(0,k)`` / ``S(0)`` for the weight of a depthwise ``nn.Conv1d`` over ``k`` equal sharded columns.

    The blocks are read from the ``split`` of the convolution's output (``[self.qkv_dim] * 3``):
    equal constant sizes adding up to the channels; blocks of unequal sizes (queries and keys
    narrower than values) have no packed placement.
    """
    channels = _depthwise_channels(model, name, param)
    if channels is None:
        return None
    blocks = _split_blocks(shapes, f"param:{name}", channels)
    if blocks is None or len(set(blocks)) != 1 or Counter(col_widths)[blocks[0]] < len(blocks):
        return None
    return strided_shard(0, len(blocks)) if len(blocks) > 1 else shard(0)


def single_column_conv(model: Any, name: str, param: Any, flow: Any, widths: Mapping[str, int]) -> Placement | None:
    """``S(0)`` for the weight of a depthwise ``nn.Conv1d`` whose input is one plainly sharded column's output.

    ``widths``: the plainly sharded columns (``S(1)``) and their output widths. The column the
    conv reads is the one layer output that every value computed with the weight depends on
    (the flow over-approximates origins, never under), and the conv must have as many channels
    as that column has outputs: a ``cat`` of several columns, or of a column and the stream,
    shows more layers there and more channels. A reshape of the column's output on its own
    (a ``view``/``split`` before the conv could reorder its features) refuses it. Masks and a
    cache's conv state (``in:`` markers, the state of the same channels' earlier tokens) may be
    mixed in: they are per channel too.
    """
    channels = _depthwise_channels(model, name, param)
    if channels is None:
        return None
    origin = f"param:{name}"
    seen = [set(o) for o in flow.edges.values() if origin in o]
    seen += [set(use.receiver) for use in flow.shapes if origin in use.receiver]
    if origin in flow.result.whole():
        seen.append(set(flow.result.whole()))
    layers = [{o for o in found if not o.startswith(("in:", "param:"))} for found in seen]
    common = set.intersection(*layers) if layers else set()
    if len(common) != 1:
        return None
    (column,) = common
    if widths.get(column) != channels:
        return None
    for use in flow.shapes:
        if column in use.receiver and origin not in use.receiver:
            if {o for o in use.receiver if not o.startswith(("in:", "param:"))} == {column}:
                return None  # the column's output reshaped on its own: its features may not reach the conv in order
    return shard(0)


def _depthwise_channels(model: Any, name: str, param: Any) -> int | None:
    """The channels of ``name`` when it is the weight of a depthwise ``nn.Conv1d``, else None.

    A convolution that mixes channels (``groups`` below the channel count) is not one a shard
    of the channels computes its share of.
    """
    import torch.nn as nn

    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if not isinstance(module, nn.Conv1d) or leaf != "weight" or param.dim() != 3 or param.shape[1] != 1:
        return None
    channels = param.shape[0]
    return channels if module.groups == module.in_channels == module.out_channels == channels else None


def _split_blocks(shapes: Any, origin: str, channels: int) -> list[int] | None:
    """The constant sizes of the split of a value computed with ``origin``, when they add up to ``channels``."""
    for use in shapes:
        if use.method not in ("split", "tensor_split") or origin not in use.receiver or not use.arg_vals:
            continue
        first = use.arg_vals[0]
        sizes = first.const
        if first.items is not None:
            sizes = [item.const for item in first.items]
        if isinstance(sizes, (list, tuple)) and all(isinstance(x, int) for x in sizes) and sum(sizes) == channels:
            return list(sizes)
        if isinstance(sizes, int) and sizes > 0 and channels % sizes == 0:
            return [sizes] * (channels // sizes)
    return None


def per_head_placement(param: Any, heads: int | None) -> Placement | None:
    """``S(d)`` for a tensor whose only non-1 dim ``d`` holds one value per query head."""
    if heads is None or heads < 2 or param.dim() < 2:
        return None
    dims = [d for d, size in enumerate(param.shape) if size != 1]
    if len(dims) == 1 and param.shape[dims[0]] == heads:
        return shard(dims[0])
    return None
