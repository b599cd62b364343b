"""Checkpoints and state dicts of a parallelized model: read, presented to DCP and FSDP2, written.

DTensor's names for a shard are :mod:`hpgen.runtime.shard_layout`, at the top level because
a pickled state dict names its ``PackedShard``.

- ``hpgen.runtime.checkpoint.loading``: ``from_pretrained``, each rank reading its slices;
- ``hpgen.runtime.checkpoint.checkpoint_files``: a checkpoint folder's safetensors files, box by box;
- ``hpgen.runtime.checkpoint.file_maps``: a file's tensors as copy-on-write views of just their bytes;
- ``hpgen.runtime.checkpoint.conversions``: checkpoint names to parameters, through transformers' conversions;
- ``hpgen.runtime.checkpoint.state_dict``: state dicts that keep every shard (DTensors out, any form in);
- ``hpgen.runtime.checkpoint.fsdp_state``: entries of parameters FSDP2 has sharded again over ``dp``;
- ``hpgen.runtime.checkpoint.dcp_files``: a DCP folder's files checked before any tensor is read;
- ``hpgen.runtime.checkpoint.saving``: ``save_pretrained``, the unsharded checkpoint, crash-safe.
"""
