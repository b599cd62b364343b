"""hpgen: lower Hugging Face modeling files and a frozen parallel plan into parallel code.

The generator pipeline reads as the package: ``hpgen.core.plan`` (load, validate) →
``hpgen.generator.index`` (libcst) → ``hpgen.core.classify`` (each entry's decision, forms) →
``hpgen.generator.emit`` (templates) → ``hpgen.generator.write`` (report, atomic files).

Layers, each a package importing only those below it (``tests/package/test_layers.py``
holds the rule and keeps this top level to a few modules; docs/architecture.md draws it);
each package's docstring maps its modules:

- core: ``hpgen.core``, the plan format (``plan``, ``plan_reader``, ``plan_entries``,
  ``plan_names``, ``plan_trust``), ``placement``, ``shards``, ``transitions``, ``decision``, ``classify``, ``header``,
  ``stubs``, ``conv1d``, ``errors``, ``durable``, ``model_config``, ``context_coverage``:
  plain data every layer shares; no torch at import time, no libcst;
- generator (core): ``hpgen.generator``, ``index``, ``resolve``, ``entry_names``,
  ``param_dims``, ``lower``, ``emit``, ``summed_edit``, ``explain``, ``targets``,
  ``generate``, ``write``: libcst in, files out;
- runtime (core): ``hpgen.runtime``, what generated files and users call; never libcst,
  the generator or the planner;
- planner (core, generator): ``hpgen.planner``, ``hpgen plan``; never the runtime;
- verify (all of the above): ``hpgen.verify``, the end-to-end check;
- cli (everything): ``cli``, ``__main__``, the only modules at this top level.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
