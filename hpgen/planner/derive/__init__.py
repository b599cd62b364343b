"""A Megatron-style tensor-parallel plan derived from the modeling source (no transformers plan needed).

The steps, in the order :func:`hpgen.planner.derive.derivation.derive` calls them for each decoder layer:

- ``hpgen.planner.derive.derivation``: the layer loop, each group taken through the steps;
- ``hpgen.planner.derive.derive_context``: what every step reads (the model, its files, ``--tp``, cached dataflows);
- ``hpgen.planner.derive.placed``: what a derivation decides (the entries it asks for, the notes, the refusals);
- ``hpgen.planner.derive.projection_groups``: column -> row groups, and what lies between their projections;
- ``hpgen.planner.derive.column_decision``: each column's layout decided in one function, every override and check in order;
- ``hpgen.planner.derive.column_layouts``: a column's typed layout and the reshape that tells it;
- ``hpgen.planner.derive.reshapes``: each column's layout read from its first reshape, the attributes to divide;
- ``hpgen.planner.derive.gathered``: columns that read another column's output whole;
- ``hpgen.planner.derive.latent``: latent down-projections (MLA), kept replicated;
- ``hpgen.planner.derive.linear_mixers``: a linear-attention mixer's depthwise conv and per-head tensors;
- ``hpgen.planner.derive.split_rows``: a row-parallel projection on its split replicated input;
- ``hpgen.planner.derive.vocab``: the embedding and the output projection;
- ``hpgen.planner.derive.group_blocks``: the boundaries of a group and the placements of its parameters.

Attention heads are in :mod:`hpgen.planner.derive.heads`, state-space mixers in
:mod:`hpgen.planner.derive.channels`.
"""
