"""What training loops call on a parallelized model, beside the optimizer.

- ``hpgen.runtime.training.clipping``: ``grad_norm`` and ``clip_grad_norm_``, the unsharded
  model's gradient norm from every rank's shards, with one all-reduce.
- ``hpgen.runtime.training.engines``: ``data_parallel``, DDP or FSDP2 over the data-parallel
  axes and ``cp`` (the engine sums the gradients over ``cp``, bucketed and overlapped), and
  ``no_sync``, either engine's accumulation without sums.
"""

from hpgen.runtime.training.engines import data_parallel, no_sync

__all__ = ["data_parallel", "no_sync"]
