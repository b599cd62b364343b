"""hpgen: lower Hugging Face modeling files and a frozen parallel plan into parallel code.

The generator pipeline reads as the package: ``plan`` (load, validate) → ``index``
(libcst) → ``classify`` (transitions, forms) → ``emit`` (templates) → ``write``
(report, atomic files). ``hpgen.runtime`` is apart and never imports libcst.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
