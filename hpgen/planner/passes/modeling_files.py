"""The modeling files a plan's boundaries live in, and the plan naming each class by file.

A multimodal model's language model often comes from another modeling file: GOT-OCR2
builds Qwen2's decoder layers through ``AutoModel.from_config``, Gemma4's assistant model
Gemma4Unified's. ``hpgen lower`` rewrites one file, so such a plan is lowered once per file.
When the boundaries' classes come from more than one file, every boundary key gets its
class in ``boundary_classes`` by qualified name (``transformers.models.qwen2.modeling_qwen2.
Qwen2Attention``), so that lowering any one of the files knows which keys are its own
(:mod:`hpgen.generator.resolve`), and the plan's ``comments`` list the files (``modeling_files``).
"""

from __future__ import annotations

import inspect
from typing import Any

from hpgen.planner.translate.draft import DraftPlan

__all__ = ["name_files"]


def _module_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except TypeError:
        return None


def name_files(model: Any, plan: DraftPlan) -> DraftPlan:
    """``plan`` with qualified ``boundary_classes`` and ``comments.modeling_files`` when its
    boundaries live in several modeling files; otherwise ``plan`` unchanged."""
    from torch import nn

    by_key: dict[str, list[nn.Module]] = {}
    for fqn, module in model.named_modules():
        found = plan.entry_for(fqn) if fqn else None
        if found is not None and found[1].is_boundary:  # the planner writes no skip_source_lowering
            by_key.setdefault(found[0], []).append(module)
    named = plan.boundary_classes
    wrapped = {key for key, name in named.items() if name in ("nn.Linear", "nn.Embedding", "nn.Identity")}
    files: dict[str, str] = {}  # module name -> file, of the source classes that get a generated forward
    classes: dict[str, str] = {}
    for key, modules in by_key.items():
        cls = type(modules[0])
        if key in wrapped:
            classes[key] = named[key]
        elif isinstance(modules[0], (nn.Linear, nn.Embedding)) and cls.__module__.startswith("torch."):
            classes[key] = "nn.Linear" if isinstance(modules[0], nn.Linear) else "nn.Embedding"
        else:
            classes[key] = f"{cls.__module__}.{cls.__qualname__}"
            path = _module_file(cls)
            if not cls.__module__.startswith("torch.") and path is not None:
                files[cls.__module__] = path
    root = type(model).__module__
    if not files or set(files) == {root}:
        return plan
    result = plan.replace(boundary_classes=dict(sorted(classes.items()))).with_comments(modeling_files=sorted(files))
    result.validated(name="hpgen plan")  # what we write must load
    return result
