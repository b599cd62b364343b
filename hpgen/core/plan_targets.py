"""The modules plans name hpgen's own local compute functions by, and where each lives now.

Plans are data: an injection names its function by a dotted path (``_target_``), and those
paths are written in users' plan files and in the planner's output. hpgen's local compute
functions moved from the runtime's top level into its role packages, but plans keep naming
them as before (``hpgen.runtime.local.experts_parallel``): :data:`PLAN_MODULES` is the one
table from each module name a plan writes to the module that holds the code, and
:func:`import_path` is what the runtime imports for a ``_target_``. The planner writes the
plan names, so its output is unchanged; the new paths are accepted as well. No module
stays behind at the old path.
"""

from __future__ import annotations

__all__ = ["PLAN_MODULES", "import_path"]

# module name as plans write it -> the module that holds its functions
PLAN_MODULES = {
    "hpgen.runtime.local": "hpgen.runtime.forward.local",
    "hpgen.runtime.local_heads": "hpgen.runtime.forward.local_heads",
    "hpgen.runtime.context_attention": "hpgen.runtime.context.attention",
}


def import_path(target: str) -> str:
    """The dotted path to import for a plan's ``_target_``: its module through :data:`PLAN_MODULES`, its name as written."""
    module, dot, name = target.rpartition(".")
    return PLAN_MODULES.get(module, module) + dot + name
