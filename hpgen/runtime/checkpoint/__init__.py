"""Checkpoints and state dicts of a parallelized model: read, presented to DCP and FSDP2, written.

DTensor's names for a shard are :mod:`hpgen.runtime.shard_layout`, at the top level because
a pickled state dict names its ``PackedShard``. Nothing here imports
:mod:`hpgen.runtime.install`: ``parallelize`` installs the state-dict hooks and
``from_pretrained`` (:mod:`hpgen.runtime.install.pretrained`) calls the loading.

- ``hpgen.runtime.checkpoint.loading``: a checkpoint read into a model built on the meta device, each rank its slices;
- ``hpgen.runtime.checkpoint.registrations``: each parameter and buffer of a model once, under all its names;
- ``hpgen.runtime.checkpoint.checkpoint_files``: a checkpoint folder's safetensors files, box by box;
- ``hpgen.runtime.checkpoint.file_maps``: a file's tensors as copy-on-write views of just their bytes;
- ``hpgen.runtime.checkpoint.conversions``: checkpoint names to parameters, through transformers' conversions;
- ``hpgen.runtime.checkpoint.state_dict``: state dicts that keep every shard (DTensors out, any form in);
- ``hpgen.runtime.checkpoint.sharded_param``: a sharded parameter's record (full shape, shard, DTensor form), and its gather;
- ``hpgen.runtime.checkpoint.fsdp_state``: entries of parameters FSDP2 has sharded again over ``dp``;
- ``hpgen.runtime.checkpoint.dcp_files``: a DCP folder's files checked before any tensor is read;
- ``hpgen.runtime.checkpoint.saving``: ``save_pretrained``, the unsharded checkpoint, crash-safe;
- ``hpgen.runtime.checkpoint.folder_swap``: a folder replaced in one step, and ``recover`` after a crash mid-swap.
"""
