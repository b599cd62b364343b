"""Local compute for an attention whose per-head input fuses the heads into the batch dim.

BLOOM builds its ``alibi`` once for all heads as ``[batch * heads, 1, length]``
(batch-major: row ``b * heads + h``). Under head sharding a rank holds the contiguous
heads ``[rank * heads / k, (rank + 1) * heads / k)``, so its rows are a chunk of *every*
batch's block: no ``S``/``SS`` placement says that, since the number of blocks is the
batch size, known only at run time. This function is the region's local compute (see
:mod:`hpgen.runtime.forward.local`): it views each named input as ``[batch, heads, ...]``, keeps
this rank's heads, flattens back, and runs the module's own body on the result::

    {"match": "transformer.h.*.self_attention",
     "local_compute_fn": {"_target_": "hpgen.runtime.local_heads.batch_major_heads",
                          "head_inputs": ["alibi"], "global_heads": 8, "axis": "tp"}}

Without ``parallelize`` (an axis of size 1) it is the body itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

__all__ = ["batch_major_heads"]


def batch_major_heads(
    module: nn.Module,
    *args: Any,
    head_inputs: Sequence[str],
    global_heads: int,
    axis: str = "tp",
    **kwargs: Any,
) -> Any:
    """Run ``module``'s body with each of ``head_inputs`` (``[batch * global_heads, ...]``) cut to this rank's heads."""
    ax = getattr(module, f"_hp_{axis}")
    if ax.size == 1:
        return module._forward_impl(*args, **kwargs)
    if global_heads % ax.size:
        raise ValueError(
            f"{type(module).__name__}: {global_heads} heads do not divide over the {ax.size} ranks of axis {axis!r}"
        )
    local = global_heads // ax.size
    bound = inspect.signature(module._forward_impl).bind(*args, **kwargs)
    for name in head_inputs:
        value = bound.arguments.get(name)
        if not isinstance(value, Tensor):
            continue  # absent (None): nothing to cut
        if value.dim() == 0 or value.shape[0] % global_heads:
            raise ValueError(
                f"{type(module).__name__}: {name} has shape {tuple(value.shape)}, whose first dim is not "
                f"batch x {global_heads} heads"
            )
        rest = value.shape[1:]
        blocks = value.reshape(-1, global_heads, *rest)
        bound.arguments[name] = blocks[:, ax.rank * local : (ax.rank + 1) * local].reshape(-1, *rest)
    return module._forward_impl(*bound.args, **bound.kwargs)
