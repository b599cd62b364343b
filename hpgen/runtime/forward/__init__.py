"""What generated forwards and wrapped modules run at every call.

- ``hpgen.runtime.forward.collectives``: autograd-aware collectives of one mesh axis;
- ``hpgen.runtime.forward.eager_collectives``: the same collectives run eagerly, one function per op;
- ``hpgen.runtime.forward.traced_collectives``: the same collectives as ``torch.compile`` traces them;
- ``hpgen.runtime.forward.moves``: a collective as data (one layout transition on one axis), shared by both forms;
- ``hpgen.runtime.forward.shard_records``: the shard sizes an axis's collectives saw in one forward, per tensor;
- ``hpgen.runtime.forward.native_ops``: which single-tensor collectives a group's backend has, found by a probe;
- ``hpgen.runtime.forward.handback``: CPU collectives that return once the backend lets go of their tensors;
- ``hpgen.runtime.forward.devices``: the device a mesh's or a group's collectives take tensors on;
- ``hpgen.runtime.forward.boundary``: the generic form's ``_hp_boundary``, each value moved to its layout;
- ``hpgen.runtime.forward.ops``: the classifier's ops at run time, and an output found in a return value;
- ``hpgen.runtime.forward.wrappers``: ``nn.Embedding``, ``nn.Linear``, ``nn.Identity`` and any other
  module outside the lowered file, as boundaries;
- ``hpgen.runtime.forward.streams``: which random numbers each rank's random ops draw;
- ``hpgen.runtime.forward.sampling``: ``generate`` giving the same tokens on every rank;
- ``hpgen.runtime.forward.context_axis``: the ``cp`` axis, its head-tail sequence shards and their collectives;
- ``hpgen.runtime.forward.local``: local compute functions a region boundary runs (experts by expert, attention by batch);
- ``hpgen.runtime.forward.local_heads``: the local compute of an attention whose per-head input fuses heads into the batch.

Plans name ``local`` and ``local_heads`` as ``hpgen.runtime.local`` and
``hpgen.runtime.local_heads`` (:mod:`hpgen.core.plan_targets`).
"""
