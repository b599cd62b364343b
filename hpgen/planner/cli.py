"""What ``hpgen plan`` and ``hpgen explain --config`` print besides the plan: notes and the sizing report.

Kept apart from :mod:`hpgen.cli` so that the command line imports torch and transformers
only for the commands that build a model.
"""

from __future__ import annotations

from typing import Any

from hpgen.errors import HpgenError

__all__ = ["plan_with_report", "sizing_for"]


def plan_with_report(
    target: str,
    *,
    tp: int | None,
    ep: int | None,
    sp: bool,
    from_source: bool,
    ep_axis: str | None = None,
    summed: bool = True,
    notes: bool,
    dtype: str,
    cp: int | None = None,
) -> tuple[str, list[str]]:
    """The plan's JSON text and the messages for stderr (notes with ``notes``, the sizing report with ``tp``)."""
    from hpgen.planner.document import dumps_plan
    from hpgen.planner.load import load_config, meta_model
    from hpgen.planner.make import plan_model
    from hpgen.planner.report import size_report

    model = meta_model(load_config(target))
    plan = plan_model(
        model, tp=tp, ep=ep, sp=sp, ep_axis=ep_axis, from_source=from_source, name=target, summed=summed, cp=cp
    )
    comments = plan.get("comments", {})
    messages = [f"{target}: {comments.get('plan_source', 'context parallel')}"]
    if comments.get("context_parallel"):
        messages.append(f"  {comments['context_parallel']}")
    if comments.get("modeling_files"):  # one `hpgen lower` per file; parallelize(..., generated=[...]) takes them
        messages.append(f"  the boundaries live in {len(comments['modeling_files'])} modeling files; lower each with this plan:")
        messages += [f"    hpgen lower {_file_of(name)} PLAN" for name in comments["modeling_files"]]
    if notes:
        for heading, key in (
            ("sharded", "sharded"),
            ("kept replicated", "replicated"),
            ("transformers' plan corrected", "corrected"),
            ("derived in place of transformers' plan", "replaced"),
            ("reduced once", "summed_reduction"),
        ):
            for pattern, text in sorted(comments.get(key, {}).items()):
                messages.append(f"  {heading}: {pattern}: {text}")
    if tp is not None and ep is None:
        try:
            messages.append(size_report(model, plan, tp=tp, dtype=dtype).text())
        except ValueError as error:
            raise HpgenError(f"--dtype: {error}") from None
    return dumps_plan(plan), messages


def _file_of(module_name: str) -> str:
    """The file of an importable module (its name when it cannot be found)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        spec = None
    return spec.origin if spec is not None and spec.origin else module_name


def sizing_for(config: str, plan: Any, *, tp: int, dtype: str) -> Any:
    """The sizing report of a loaded ``plan`` for the model of ``config`` (a model type or config.json)."""
    from hpgen.planner.load import load_config, meta_model
    from hpgen.planner.report import size_report

    model = meta_model(load_config(config))
    try:
        return size_report(model, plan, tp=tp, dtype=dtype)
    except ValueError as error:
        raise HpgenError(f"--dtype: {error}") from None
