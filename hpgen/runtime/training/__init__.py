"""What training loops call on a parallelized model, beside the optimizer.

- ``hpgen.runtime.training.clipping``: ``grad_norm`` and ``clip_grad_norm_``, the unsharded
  model's gradient norm from every rank's shards, with one all-reduce.
"""
