"""``hpgen plan``: a frozen plan for a transformers model, translated from its own plan or derived from its source.

torch and transformers are imported only inside the functions that build or read a model.

Module map, in the order a plan is made (tests/test_layers.py checks that it names every
module of the package; :mod:`hpgen.planner.flow` has a map of its own):

- entry: :mod:`~hpgen.planner.cli` (the command), :mod:`~hpgen.planner.make` (the choice
  of planner: transformers' plan where it shards the layers, else the derivation; then
  the steps after either), :mod:`~hpgen.planner.load` (the config, the model on the meta
  device, its modeling file).
- translating transformers' ``base_model_tp_plan`` / ``base_model_ep_plan``
  (:mod:`~hpgen.planner.translator`, whose
  :func:`~hpgen.planner.translator.translated_draft` calls one function per step, each
  reading a :mod:`~hpgen.planner.plan_context` and returning what the next takes):
  :mod:`~hpgen.planner.styles` (each style, the rules on concrete modules and axes),
  :mod:`~hpgen.planner.corrections` (styles the source contradicts, corrected),
  :mod:`~hpgen.planner.blocks` (the boundaries the styles imply, the parameters inside
  them), :mod:`~hpgen.planner.checks` (the axes divide heads, experts and vocabulary
  rows), :mod:`~hpgen.planner.sequence` (``--sp``), :mod:`~hpgen.planner.signatures`
  (each class's ``forward``: a boundary's inputs and outputs),
  :mod:`~hpgen.planner.document` (the plan, grouped into ``*`` keys),
  :mod:`~hpgen.planner.boundary` (the record of one boundary the steps fill in),
  :mod:`~hpgen.planner.draft` (the plan while it is written: typed entries, one
  document at the end of :mod:`~hpgen.planner.make`).
- deriving a plan from the modeling source (:mod:`~hpgen.planner.derive`, the layer
  loop calling each step, a function handed what it reads and returning what it decides):
  :mod:`~hpgen.planner.derive_context` (what every step reads: the model, its files, ``--tp``,
  the cached dataflows); :mod:`~hpgen.planner.flow` (which layer feeds which, by an
  abstract run of the ``forward`` bodies); :mod:`~hpgen.planner.groups` (column -> row
  groups, and what lies between their projections); :mod:`~hpgen.planner.heads`,
  :mod:`~hpgen.planner.head_names`, :mod:`~hpgen.planner.reshapes`,
  :mod:`~hpgen.planner.layouts` (attention heads, each column's typed layout, the
  attributes to divide); :mod:`~hpgen.planner.head_shares` (each rank's whole heads where
  they do not divide ``--tp``, and the placements that cut them; the translator's checks use
  it too), :mod:`~hpgen.planner.uneven_heads` (a group's projections cut that way, and each
  rank's count of the attributes that size its heads); :mod:`~hpgen.planner.head_cuts`, :mod:`~hpgen.planner.head_inputs` (per-head
  inputs made outside the attention, ALiBi); :mod:`~hpgen.planner.head_parts` (heads
  split into parts working together); :mod:`~hpgen.planner.head_maps`,
  :mod:`~hpgen.planner.head_params` (a leaf applying one matrix to each head's features;
  per-head scales, shared maps and channel weights read between the projections);
  :mod:`~hpgen.planner.gathered` (columns that read another column whole);
  :mod:`~hpgen.planner.latent` (latent down-projections, MLA, kept replicated);
  :mod:`~hpgen.planner.mixers` (a linear-attention mixer's depthwise conv and per-head
  tensors); :mod:`~hpgen.planner.channels`, :mod:`~hpgen.planner.state_leaves`
  (channel-parallel state-space mixers and their per-channel state leaves);
  :mod:`~hpgen.planner.derived_blocks` (the boundaries of a group);
  :mod:`~hpgen.planner.split_rows` (a row-parallel projection on its split replicated
  input); :mod:`~hpgen.planner.vocab` (the embedding and output projection);
  :mod:`~hpgen.planner.entries` (what a derivation decides); :mod:`~hpgen.planner.modules`
  (small questions about modules); :mod:`~hpgen.planner.derived_plan` (the derivation
  written as a plan, calling the translator's steps from ``--sp`` on).
- after either: :mod:`~hpgen.planner.crosscheck` (blocks of transformers' plan the
  source contradicts fall back), :mod:`~hpgen.planner.summed` (parallel-residual blocks
  reduced once), :mod:`~hpgen.planner.files` (boundaries in several modeling files),
  :mod:`~hpgen.planner.attn_dp` (``--attn-dp``: the ``--ep`` plan rewritten for
  data-parallel attention);
  :mod:`~hpgen.planner.context_plan` (``--cp``: the sequence cut over a ``cp`` axis).
- :mod:`~hpgen.planner.report` sizes a plan per rank (parameter bytes, collectives).
"""
