"""Channel-parallel state-space mixers (Mamba and its kin) in a derivation.

- ``hpgen.planner.derive.channels.state_space``: a mixer's channels sharded between its in and out projections;
- ``hpgen.planner.derive.channels.state_leaves``: the per-channel state leaves such a mixer reads.
"""
