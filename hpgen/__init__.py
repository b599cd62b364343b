"""hpgen: lower Hugging Face modeling files and a frozen parallel plan into parallel code.

The generator pipeline reads as the package: ``plan`` (load, validate) → ``index``
(libcst) → ``classify`` (transitions, forms) → ``emit`` (templates) → ``write``
(report, atomic files).

Layers, each importing only those below it (``tests/package/test_layers.py`` holds the rule;
docs/architecture.md draws it):

- core: ``hpgen.core`` (its docstring maps its modules): the plan format (``plan``,
  ``plan_reader``, ``plan_entries``, ``plan_names``, ``plan_trust``), ``placement``,
  ``shards``, ``classify``, ``header``, ``stubs``, ``conv1d``, ``errors``, ``durable``,
  ``model_config``, ``context_coverage``: plain data every layer shares; no torch at
  import time, no libcst;
- generator (core): ``index``, ``resolve``, ``emit``, ``lower``, ``write``, ``targets``,
  ``explain``, ``generate``, ``summed_edit``, ``param_dims``, ``entry_names``: libcst in,
  files out;
- runtime (core): ``hpgen.runtime``, what generated files and users call; never libcst,
  the generator or the planner;
- planner (core, generator): ``hpgen.planner``, ``hpgen plan``; never the runtime;
- verify (all of the above): ``hpgen.verify``, the end-to-end check;
- cli (everything): ``cli``, ``__main__``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
