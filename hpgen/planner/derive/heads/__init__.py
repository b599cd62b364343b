"""Attention heads in a derivation: their counts and sizes, their shares over ``--tp``, what follows them.

- ``hpgen.planner.derive.heads.rules``: head counts and sizes, which layers work on whole heads, the head checks;
- ``hpgen.planner.derive.heads.counts``: an attention's heads as one value (query, key/value, head size);
- ``hpgen.planner.derive.heads.attr_names``: the attribute names that hold head counts and sizes;
- ``hpgen.planner.derive.heads.shares``: each rank's whole heads where they do not divide ``--tp``;
- ``hpgen.planner.derive.heads.uneven``: a group's projections cut by those shares, per-rank attribute counts;
- ``hpgen.planner.derive.heads.parts``: heads split into parts working together (differential attention);
- ``hpgen.planner.derive.heads.input_dims``: where a per-head input made outside the attention carries its heads;
- ``hpgen.planner.derive.heads.input_cuts``: how such an input (ALiBi) is cut to a rank's heads;
- ``hpgen.planner.derive.heads.maps``: a leaf applying one matrix to each head's features alone;
- ``hpgen.planner.derive.heads.per_head_params``: per-head scales, shared maps and channel weights read between the projections.
"""
