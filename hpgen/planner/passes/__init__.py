"""What runs on a draft plan after either planner, each pass returning a new draft.

- ``hpgen.planner.passes.crosscheck``: blocks of transformers' plan the source contradicts fall back;
- ``hpgen.planner.passes.feature_statistics``: a block reducing a column-sharded value's features, read from source;
- ``hpgen.planner.passes.summed_reductions``: parallel-residual blocks whose two branches are reduced once;
- ``hpgen.planner.passes.modeling_files``: boundaries in several modeling files, each class named by file;
- ``hpgen.planner.passes.context_parallel``: ``--cp``, the sequence cut over a ``cp`` axis, alone or outside ``tp``;
- ``hpgen.planner.passes.data_parallel_attention``: ``--attn-dp``, the ``--ep`` plan rewritten for data-parallel
  attention around the experts;
- ``hpgen.planner.passes.pipeline_stages``: ``--pp``, the decoder layers cut into pipeline stages on a ``pp`` axis.
"""
