"""transformers' plans translated into boundaries, and the steps both planners write a plan with.

- ``hpgen.planner.translate.translator``: ``translated_draft``, one function per step;
- ``hpgen.planner.translate.plan_context``: what every step reads (the model, its modules, files, the mesh);
- ``hpgen.planner.translate.styles``: each style of transformers' plans, on concrete modules and axes;
- ``hpgen.planner.translate.expert_tp``: the experts' tensor-parallel rules a release's tp_plan leaves out (5.25);
- ``hpgen.planner.translate.corrections``: styles the source contradicts, corrected;
- ``hpgen.planner.translate.style_blocks``: the boundaries the styles imply, and the parameters inside them;
- ``hpgen.planner.translate.axis_checks``: the mesh axes divide heads, experts and vocabulary rows;
- ``hpgen.planner.translate.sequence_parallel``: ``--sp``, the stream sharded on the sequence between blocks;
- ``hpgen.planner.translate.forwards``: each class's ``forward`` read from its modeling file (parameters, returns);
- ``hpgen.planner.translate.signatures``: a translated boundary's inputs and outputs, by its kind and style;
- ``hpgen.planner.translate.boundary_record``: the record of one boundary the steps fill in;
- ``hpgen.planner.translate.document``: the plan written out, grouped into ``*`` keys;
- ``hpgen.planner.translate.draft``: the plan while it is written (typed entries, one document at the end);
- ``hpgen.planner.translate.derived_plan``: a derivation written as a plan through the steps from ``--sp`` on.
"""
