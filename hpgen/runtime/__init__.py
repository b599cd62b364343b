"""hpgen's runtime: what generated files call, and ``parallelize``.

Importable without libcst. ``parallelize``, ``from_pretrained`` (load a transformers
checkpoint, each rank reading its slices), ``save_pretrained`` / ``full_state_dict``
(the unsharded checkpoint of a parallelized model), ``local_state_dict`` (plain local
shards), ``optimizer_state_dict`` / ``load_optimizer_state_dict`` (optimizer state for
DCP, sharded like the parameters), ``checked_reader`` (a DCP reader that checks the
checkpoint's files before reading any) and ``reseed_random_streams`` (the streams
train-mode random ops draw from) are loaded on first use so that generated files, which import
``hpgen.runtime.defaults``, do not pay for them.

Module map, by role (docs/runtime.md has the same table; ``tests/test_layers.py`` checks
that it names every module and nothing else):

- survey and install (``parallelize``): ``install``, ``agreement``, ``targets``,
  ``counterparts``, ``params``, ``attrs``, ``groups``, ``hooks``, ``summed``, ``kernels``,
  ``stubs``, ``inputs``, ``tuners``, ``errors``;
- forward (what generated forwards call): ``defaults``, ``collectives``,
  ``traced_collectives``, ``handback``, ``boundary``, ``ops``, ``wrappers``, ``local``,
  ``local_heads``, ``streams``, ``sampling``;
- shard layout (DTensor's names for the core's :class:`hpgen.shards.ShardLayout`):
  ``shard_layout``;
- checkpoints: ``loading``, ``checkpoint_files``, ``file_maps``, ``conversions``,
  ``state_dict``, ``fsdp_state``, ``dcp_files``, ``saving``, ``folder_swap``, ``adapters``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "checked_reader",
    "from_pretrained",
    "full_state_dict",
    "load_optimizer_state_dict",
    "local_state_dict",
    "optimizer_state_dict",
    "parallelize",
    "reseed_random_streams",
    "save_pretrained",
]

_LAZY = {
    "checked_reader": "hpgen.runtime.dcp_files",
    "parallelize": "hpgen.runtime.install",
    "from_pretrained": "hpgen.runtime.loading",
    "reseed_random_streams": "hpgen.runtime.streams",
    "save_pretrained": "hpgen.runtime.saving",
    "full_state_dict": "hpgen.runtime.saving",
    "local_state_dict": "hpgen.runtime.state_dict",
    "optimizer_state_dict": "hpgen.runtime.state_dict",
    "load_optimizer_state_dict": "hpgen.runtime.state_dict",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpgen.runtime' has no attribute {name!r}")
