"""``hpgen plan``: a frozen plan for a transformers model, translated from its own plan or derived from its source.

The modules, in the order a plan is made (torch and transformers are imported only
inside the functions that build or read a model):

- :mod:`~hpgen.planner.cli`, :mod:`~hpgen.planner.make`: the command's entry, and the
  choice of planner (transformers' plan where it shards the layers, else the derivation);
- :mod:`~hpgen.planner.load`: the config, the model on the meta device, its modeling file.

Translating transformers' ``base_model_tp_plan`` / ``base_model_ep_plan``
(:mod:`~hpgen.planner.translator`, one :class:`~hpgen.planner.translator.Translator`
whose steps are its base classes):

- :mod:`~hpgen.planner.styles`: each style, and the rules on concrete modules and axes (TP, EP);
- :mod:`~hpgen.planner.blocks`: the boundaries the styles imply, the parameters inside them;
- :mod:`~hpgen.planner.checks`: the axes divide heads, experts and vocabulary rows;
- :mod:`~hpgen.planner.sequence`: sequence-parallel rules (``--sp``);
- :mod:`~hpgen.planner.signatures`: each boundary's inputs and outputs, from its ``forward``;
- :mod:`~hpgen.planner.document`: the plan document, grouped into ``*`` keys;
- :mod:`~hpgen.planner.boundary`: the record of one boundary the steps fill in.

Deriving a plan from the modeling source (:mod:`~hpgen.planner.derive`):

- :mod:`~hpgen.planner.flow`: which layer feeds which, by an abstract run of the ``forward`` bodies;
- :mod:`~hpgen.planner.groups`: column -> row groups, and what lies between their projections;
- :mod:`~hpgen.planner.heads`, :mod:`~hpgen.planner.reshapes`, :mod:`~hpgen.planner.layouts`:
  attention heads, fused layouts, the attributes to divide;
- :mod:`~hpgen.planner.latent`: latent down-projections (MLA) kept replicated in the block;
- :mod:`~hpgen.planner.mixers`: a linear-attention mixer's depthwise conv and per-head tensors;
- :mod:`~hpgen.planner.head_maps`, :mod:`~hpgen.planner.head_params`: a leaf applying one matrix to each
  head's features, and the per-head scales, shared maps and channel weights read between the projections;
- :mod:`~hpgen.planner.derived_blocks`: the boundaries of a group;
- :mod:`~hpgen.planner.split_rows`: a row-parallel projection on its split replicated input,
  where no group shards it;
- :mod:`~hpgen.planner.vocab`: the embedding and output projection;
- :mod:`~hpgen.planner.entries`: what a derivation decides; :mod:`~hpgen.planner.modules`:
  small questions about modules;
- :mod:`~hpgen.planner.translate`: the derivation written as a plan (the translator's later steps).

:mod:`~hpgen.planner.report` sizes a plan per rank (parameter bytes, collectives).
"""
