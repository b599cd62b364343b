"""hpgen's core: the plan format, shard arithmetic and the small helpers every layer shares.

Plain data: no torch at import time, no libcst; the generator, the planner and the runtime
import it, and it imports none of them (``tests/package/test_layers.py`` holds the rule).

Module map:

- the plan format: ``hpgen.core.plan`` (loading a plan file, the names every layer imports),
  ``hpgen.core.plan_reader`` (validating a decoded document), ``hpgen.core.plan_entries``
  (the data a validated plan becomes and what it answers), ``hpgen.core.plan_names`` (name
  checks, FQN patterns), ``hpgen.core.plan_trust`` (which functions a plan may make hpgen
  import), ``hpgen.core.plan_targets`` (the module names plans give hpgen's local compute
  functions, and where those live);
- placements and shards: ``hpgen.core.placement`` (one tensor's layout on one mesh axis),
  ``hpgen.core.shards`` (tensor_split and chunk sizes and bounds, heads per row shard,
  ``ShardLayout``);
- from entries to operations and forms, read by the generator and the runtime alike:
  ``hpgen.core.transitions`` (one placement change into one op, an entry's values into
  their ops), ``hpgen.core.decision`` (one answer per plan entry -- ops, identity, contract
  signature, injection, sharded axes -- made once and kept with the plan),
  ``hpgen.core.classify`` (a contract's form against the indexed ``forward``),
  ``hpgen.core.shared_sizes`` (the values of one boundary cut alike, whose ops share one
  size lookup);
- what generated files and modeling files carry: ``hpgen.core.header`` (the generated
  file's header and hash), ``hpgen.core.stubs`` (kernel-stub detection),
  ``hpgen.core.conv1d`` (transformers' ``Conv1D`` by duck typing);
- shared helpers: ``hpgen.core.errors`` (``HpgenError``, bad input with its place),
  ``hpgen.core.durable`` (fsync and rename steps of the generator's writes and the
  runtime's checkpoint saves), ``hpgen.core.model_config`` (a config attribute that may be
  per layer), ``hpgen.core.context_coverage`` (the ``cp`` axis's names and what context
  parallelism does not cover).
"""
