"""The generated class of a module built from the original modeling file.

A multimodal model builds its language model with ``AutoModel.from_config(text_config)``:
even in a model built from a generated file, those submodules are transformers' own
classes (``transformers.models.gemma3.modeling_gemma3.Gemma3Attention``), and when the
decoder layers are another model's (GOT-OCR2's are Qwen2's) they come from another
modeling file altogether. ``hpgen lower`` rewrites one file; the plan's boundaries may
live in several. :func:`generated_modules` collects the generated files the runtime may
take classes from (those of the model's own classes, and those passed to
``parallelize(..., generated=...)``), and :func:`counterpart` finds in them the
generated class lowered from the very source a module's class comes from: the same
qualified name, in a generated file whose header records that source file's name and
sha256. The instance then takes that class, as it takes a generated ``_hp<N>``
subclass; both classes come from the same ``__init__``, so the instance's attributes
fit.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import types
from collections.abc import Iterable
from pathlib import Path

from torch import nn

from hpgen.core.header import Header, read_header
from hpgen.runtime.errors import ParallelizeError

__all__ = ["GeneratedModule", "counterpart", "generated_modules", "is_generated_file"]


class GeneratedModule:
    """One imported generated file: the module and what its header records."""

    def __init__(self, module: types.ModuleType, header: Header) -> None:
        self.module = module
        self.header = header

    def lowered_from(self, source: Path) -> bool:
        """True when this file was lowered from ``source`` as it is on disk now."""
        if self.header.source_name != source.name:
            return False
        try:
            return hashlib.sha256(source.read_bytes()).hexdigest() == self.header.source_sha256
        except OSError:
            return False


def is_generated_file(module: types.ModuleType | None) -> bool:
    """``module`` was written by ``hpgen lower`` (its file starts with hpgen's header)."""
    return module is not None and _header_of(module) is not None


def _header_of(module: types.ModuleType) -> Header | None:
    path = getattr(module, "__file__", None)
    if path is None:
        return None
    try:
        return read_header(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None


def generated_modules(model: nn.Module, extra: Iterable[types.ModuleType] = ()) -> list[GeneratedModule]:
    """The generated files the model's classes come from, then ``extra`` (each checked)."""
    found: dict[str, GeneratedModule] = {}
    for cls in {type(module) for module in model.modules()}:
        module = sys.modules.get(cls.__module__)
        if module is None or module.__name__ in found:
            continue
        header = _header_of(module)
        if header is not None:
            found[module.__name__] = GeneratedModule(module, header)
    for module in extra:
        if not isinstance(module, types.ModuleType):
            raise ParallelizeError(
                f"generated= takes imported modules of files written by `hpgen lower`; got {type(module).__name__}"
            )
        header = _header_of(module)
        if header is None:
            raise ParallelizeError(
                f"generated=: {module.__name__} ({getattr(module, '__file__', 'no file')}) is not a file written by "
                "`hpgen lower` (it has no hpgen header)"
            )
        found.setdefault(module.__name__, GeneratedModule(module, header))
    return list(found.values())


def counterpart(cls: type, generated: Iterable[GeneratedModule]) -> type | None:
    """The generated class lowered from the source ``cls`` is defined in, or ``None``.

    Only a class that carries a generated ``forward`` (``_hp_boundary_form``) counts; two
    generated files lowered from the same source that both have one are ambiguous.
    """
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return None
    if path is None:
        return None
    source = Path(path)
    found = []
    for item in generated:
        if item.module.__name__ == cls.__module__ or not item.lowered_from(source):
            continue
        candidate = getattr(item.module, cls.__qualname__, None)
        if isinstance(candidate, type) and hasattr(candidate, "_hp_boundary_form"):
            found.append(candidate)
    if len(found) > 1:
        names = ", ".join(sorted(c.__module__ for c in found))
        raise ParallelizeError(
            f"{cls.__qualname__} ({cls.__module__}) has a generated forward in more than one generated file "
            f"({names}); pass only the one lowered with this plan"
        )
    return found[0] if found else None
