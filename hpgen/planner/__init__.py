"""``hpgen plan``: a frozen plan for a transformers model, translated from its own plan or derived from its source.

torch and transformers are imported only inside the functions that build or read a model.

Module map. The planner is in subpackages by role, listed from the bottom up: each imports
only those above it in this list (and the core and the generator), which
``tests/package/test_layers.py`` checks, with that this map and each subpackage's docstring name
every module, each once:

- ``hpgen.planner.model`` (the model read): ``load``, ``modules``;
- ``hpgen.planner.flow`` (which layer feeds which, by an abstract run of the ``forward``
  bodies; a map of its own): ``runner``, ``statements``, ``expressions``, ``functions``,
  ``values``, ``constants``, ``module_level``, ``caller_nones``, ``protocols``;
- ``hpgen.planner.derive`` (a plan derived from the modeling source: the layer loop, the
  column -> row groups, each column's layout, the boundaries): ``derivation``,
  ``derive_context``, ``placed``, ``projection_groups``, ``column_decision``, ``column_layouts``, ``reshapes``,
  ``gathered``, ``latent``, ``linear_mixers``, ``split_rows``, ``vocab``, ``group_blocks``;
- ``hpgen.planner.derive.heads`` (attention heads: counts, shares over ``--tp``, parts,
  per-head inputs and parameters): ``rules``, ``counts``, ``attr_names``, ``shares``, ``uneven``,
  ``parts``, ``input_dims``, ``input_cuts``, ``maps``, ``per_head_params``;
- ``hpgen.planner.derive.channels`` (channel-parallel state-space mixers): ``state_space``,
  ``state_leaves``;
- ``hpgen.planner.translate`` (transformers' ``base_model_tp_plan`` / ``base_model_ep_plan``
  translated into boundaries, and the steps both planners write a plan with): ``translator``,
  ``plan_context``, ``styles``, ``expert_tp``, ``corrections``, ``style_blocks``, ``axis_checks``,
  ``sequence_parallel``, ``forwards``, ``signatures``, ``boundary_record``, ``document``, ``draft``,
  ``derived_plan``;
- ``hpgen.planner.passes`` (what runs after either planner): ``crosscheck``,
  ``feature_statistics``, ``summed_reductions``, ``modeling_files``, ``context_parallel``, ``data_parallel_attention``,
  ``pipeline_stages``;
- ``hpgen.planner.entry`` (what ``hpgen plan`` calls): ``make``, ``printout``,
  ``sizing_report``.
"""
