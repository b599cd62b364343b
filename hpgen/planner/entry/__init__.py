"""What ``hpgen plan`` (and ``hpgen explain --config``) call.

- ``hpgen.planner.entry.make``: the choice of planner (transformers' plan where it shards the layers, else the
  derivation), then the passes after either;
- ``hpgen.planner.entry.printout``: what ``hpgen plan`` prints besides the plan (notes, the sizing report);
- ``hpgen.planner.entry.sizing_report``: what a plan costs per rank (parameter bytes, collectives).
"""
