"""hpgen's generator: modeling files and a plan in, generated files out (``hpgen lower``, ``check``, ``explain``).

It reads sources with libcst and imports only the core (``hpgen.core``); the planner reads
modeling files through its index and explanation, so the planner sits above it, and the
runtime never imports it (``tests/package/test_layers.py`` holds both).

Module map, in the order a file goes through:

- reading the source: ``hpgen.generator.index`` (a read-only index of a modeling file:
  parse it twice, walk its top level), ``hpgen.generator.index_records`` (the records the
  index is made of: classes, forwards, returns, children, imports),
  ``hpgen.generator.body_scan`` (a ``forward`` body: signature, returns, parameters handed
  on whole), ``hpgen.generator.init_scan`` (what a class builds: children, attributes,
  parameter dims), ``hpgen.generator.resolve`` (which class each
  boundary FQN is, from ``__init__`` assignments), ``hpgen.generator.entry_names`` (every
  plan entry names a module and parameters the source builds), ``hpgen.generator.param_dims``
  (a placement's dim against the parameter's dims);
- writing the code: ``hpgen.generator.lower`` (``lower(source_text, plan) -> str`` and the
  analysis behind it), ``hpgen.generator.emit`` (the templates rendered and spliced into the
  tree), ``hpgen.generator.summed_edit`` (a parallel-residual block's sum, reduced once);
- reading it out: ``hpgen.generator.explain`` (``hpgen explain``: per class its ops and
  collectives);
- targets and files: ``hpgen.generator.targets`` (what to generate, from the command line or
  ``[tool.hpgen]``), ``hpgen.generator.generate`` (one target end to end, and whether its
  output is fresh), ``hpgen.generator.write`` (the one file writer, diffs, the report that
  owns exit codes).
"""
