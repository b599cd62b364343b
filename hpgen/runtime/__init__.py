"""hpgen's runtime: what generated files call, and ``parallelize``.

Importable without libcst. ``parallelize``, ``from_pretrained`` (load a transformers
checkpoint, each rank reading its slices), ``save_pretrained`` / ``full_state_dict``
(the unsharded checkpoint of a parallelized model), ``local_state_dict`` (plain local
shards), ``optimizer_state_dict`` / ``load_optimizer_state_dict`` (optimizer state for
DCP, sharded like the parameters), ``checked_reader`` (a DCP reader that checks the
checkpoint's files before reading any), ``reseed_random_streams`` (the streams
train-mode random ops draw from), ``grad_norm`` / ``clip_grad_norm_`` (the unsharded
model's gradient norm, and clipping by it) and ``give_shard_sizes`` (serving code's
per-rank token counts for the next forward) are loaded on first use so that generated files, which import
``hpgen.runtime.defaults``, do not pay for them.

Module map. The top level keeps only the modules that something outside hpgen names by
path in code: generated files import ``defaults``; users call ``context_logits.shard_logits``
and catch ``errors.ParallelizeError`` (which every group raises); ``torch.save`` of a state
dict holding an ``SS`` parameter records ``shard_layout.PackedShard``; users train with
``trainer.Trainer`` (transformers' ``Trainer`` for parallelized models). Plans name the local
compute functions (``forward.local``, ``forward.local_heads``, ``context.attention``) by
their old module names, led to them by ``hpgen.core.plan_targets``. Everything else is in
a subpackage by role, whose docstring says what each of its modules does. docs/runtime.md
has the same table; ``tests/package/test_layers.py`` checks that both name every module,
each in exactly one group:

- ``hpgen.runtime`` (named from outside hpgen): ``defaults``, ``context_logits``, ``errors``,
  ``shard_layout``, ``trainer``;
- ``hpgen.runtime.install`` (survey and install: what ``parallelize`` runs): ``parallelize``,
  ``pretrained``, ``agreement``, ``launch_checks``, ``module_decisions``, ``module_installs``, ``counterparts``, ``params``, ``attrs``,
  ``groups``, ``hooks``, ``summed``, ``kernels``, ``replaced_stubs``, ``inputs``, ``tuners``,
  ``adapters``, ``wrapped``, ``stock_loops``, ``context_checks``;
- ``hpgen.runtime.forward`` (what generated forwards call): ``collectives``,
  ``eager_collectives``, ``traced_collectives``, ``moves``, ``shard_records``, ``native_ops``, ``handback``,
  ``devices``, ``boundary``, ``ops``, ``wrappers``, ``streams``, ``sampling``, ``context_axis``, ``local``,
  ``local_heads``;
- ``hpgen.runtime.context`` (context parallelism: attention by blocks and the layout handed to it,
  the key/value cache split for decoding, decode attention, the log-sum-exp merge): ``attention``, ``blockwise``,
  ``sequence``, ``cache``, ``decode``, ``merge``;
- ``hpgen.runtime.checkpoint`` (checkpoints and state dicts: read, presented to DCP and
  FSDP2, written): ``loading``, ``registrations``, ``checkpoint_files``, ``file_maps``,
  ``conversions``, ``state_dict``, ``sharded_param``, ``fsdp_state``, ``dcp_files``, ``saving``, ``folder_swap``;
- ``hpgen.runtime.training`` (what training loops call beside the optimizer): ``clipping``, ``engines``;
- ``hpgen.runtime.pipeline`` (pipeline stages: the stage kept, the schedule step, the inference relay):
  ``stages``, ``tied``, ``attach``, ``stage_forward``, ``schedule``, ``relay``, ``gather``.

The subpackages import the top level and each other in one direction: ``install``
imports ``checkpoint`` (``parallelize`` installs the state-dict hooks, ``from_pretrained``
reads the checkpoint into the shards) and ``pipeline`` (the stage kept), never the reverse, and ``forward`` imports neither:
what generated forwards run needs no install or checkpoint code.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "checked_reader",
    "clip_grad_norm_",
    "from_pretrained",
    "full_state_dict",
    "give_shard_sizes",
    "grad_norm",
    "load_optimizer_state_dict",
    "local_state_dict",
    "optimizer_state_dict",
    "parallelize",
    "reseed_random_streams",
    "save_pretrained",
]

_LAZY = {
    "checked_reader": "hpgen.runtime.checkpoint.dcp_files",
    "clip_grad_norm_": "hpgen.runtime.training.clipping",
    "grad_norm": "hpgen.runtime.training.clipping",
    "give_shard_sizes": "hpgen.runtime.forward.collectives",
    "parallelize": "hpgen.runtime.install.parallelize",
    "from_pretrained": "hpgen.runtime.install.pretrained",
    "reseed_random_streams": "hpgen.runtime.forward.streams",
    "save_pretrained": "hpgen.runtime.checkpoint.saving",
    "full_state_dict": "hpgen.runtime.checkpoint.saving",
    "local_state_dict": "hpgen.runtime.checkpoint.state_dict",
    "optimizer_state_dict": "hpgen.runtime.checkpoint.state_dict",
    "load_optimizer_state_dict": "hpgen.runtime.checkpoint.state_dict",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpgen.runtime' has no attribute {name!r}")
