"""``hpgen verify``: prove a plan exact on a tiny copy of its model before a job runs.

One job a module, in the order a check runs:

- :mod:`~hpgen.verify.shrink`: the tiny config (same architecture and layers, sizes that
  still divide over the plan's axes), shared with ``benchmarks/coverage.py``;
- :mod:`~hpgen.verify.prepare`: the plan, the config and the source lowered with the plan;
- :mod:`~hpgen.verify.spawn`: gloo ranks on the CPU (file-store rendezvous, no hang);
- :mod:`~hpgen.verify.run`: many cases in one spawn (:func:`~hpgen.verify.run.verify_many`);
- :mod:`~hpgen.verify.compare`: one rank's comparison with the unsharded model (logits,
  gradients, greedy generation; train mode's agreement across ranks);
- :mod:`~hpgen.verify.hang`: where each rank waits (the collective it last entered and the
  module that entered it), named when a collective never completes;
- :mod:`~hpgen.verify.localize`: the first boundary whose output or input gradient departs;
- :mod:`~hpgen.verify.report`: the verdict as text or JSON, with what the plan declares
  there and what ``hpgen plan`` would declare;
- :mod:`~hpgen.verify.command`: ``hpgen verify``'s command body (prepare, run on ranks,
  report; progress on stderr), kept apart from :mod:`hpgen.cli`.

The runtime never imports this package; it imports the planner and the runtime. torch and
transformers are imported by the modules that run models, not by this package itself.
"""
