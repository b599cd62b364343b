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
    dtype: str | None,
    cp: int | None = None,
    attn_dp: bool = False,
) -> tuple[str, list[str]]:
    """The plan's JSON text and the messages for stderr (notes with ``notes``, the sizing report with ``tp``)."""
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import load_config, meta_model
    from hpgen.planner.translate.document import dumps_plan

    model = meta_model(load_config(target))
    if attn_dp and (ep is None or sp):
        raise HpgenError("--attn-dp: give --ep N (and --tp M for attention tensor-parallel inside each group; not --sp)")
    if attn_dp and cp is not None:
        raise HpgenError("--attn-dp: not with --cp (attention cannot be data-parallel and context-parallel at once)")
    if attn_dp:
        from hpgen.planner.passes.data_parallel_attention import data_parallel_attention

        expert_plan = plan_model(model, ep=ep, ep_axis=ep_axis, from_source=from_source, name=target, summed=summed)
        tp_plan = None if tp is None else plan_model(model, tp=tp, from_source=from_source, name=target, summed=summed)
        plan = data_parallel_attention(model, expert_plan, target, tp_plan)
    else:
        plan = plan_model(
            model, tp=tp, ep=ep, sp=sp, ep_axis=ep_axis, from_source=from_source, name=target, summed=summed, cp=cp
        )
    plan["planned_for"] = _planned_for(plan["mesh_dim_names"], tp=tp, ep=ep, cp=cp)
    comments = plan.get("comments", {})
    messages = [f"{target}: {comments.get('plan_source', 'context parallel')}"]
    if comments.get("context_parallel"):
        messages.append(f"  {comments['context_parallel']}")
    if comments.get("derived_because"):  # transformers' plan shards a fused projection the heads do not divide
        messages.append(f"  not transformers' plan: {comments['derived_because']}")
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
        messages.append(_sized(model, plan, tp, dtype).text())
    return dumps_plan(plan), messages


def _planned_for(mesh: list[str], *, tp: int | None, ep: int | None, cp: int | None) -> dict[str, int]:
    """Each axis's size as the command gave it (``cp``; ``tp``, which the experts share without ``--ep-axis``;
    the experts' own axis): recorded in the plan, so that ``parallelize`` on another mesh can say which sizes
    the plan was written for."""
    sizes = {}
    for axis in mesh:
        size = cp if axis == "cp" else (tp if tp is not None else ep) if axis == "tp" else ep
        if size is not None:
            sizes[axis] = size
    return sizes


# the sizing report's dtype when neither --dtype nor the config names one (a model type's defaults)
DEFAULT_REPORT_DTYPE = "bfloat16"


def report_dtype(config: Any, dtype: str | None) -> tuple[str, str]:
    """The sizing report's dtype and where it comes from: ``--dtype``, else the config's
    ``dtype`` (``torch_dtype`` in older files: the checkpoint's), else bfloat16."""
    if dtype is not None:
        return dtype, "--dtype"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for source in (text, config):
        found = getattr(source, "dtype", None) or getattr(source, "torch_dtype", None)
        if found is not None:
            return str(found).replace("torch.", ""), "the config's dtype; --dtype to change"
    return DEFAULT_REPORT_DTYPE, "the config names no dtype; --dtype to change"


def _sized(model: Any, plan: Any, tp: int, dtype: str | None) -> Any:
    from hpgen.planner.entry.sizing_report import size_report

    chosen, source = report_dtype(model.config, dtype)
    try:
        return size_report(model, plan, tp=tp, dtype=chosen, dtype_from=source)
    except ValueError as error:
        raise HpgenError(f"--dtype: {error}") from None


def _file_of(module_name: str) -> str:
    """The file of an importable module (its name when it cannot be found)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        spec = None
    return spec.origin if spec is not None and spec.origin else module_name


def sizing_for(config: str, plan: Any, *, tp: int, dtype: str | None) -> Any:
    """The sizing report of a loaded ``plan`` for the model of ``config`` (a model type or config.json)."""
    from hpgen.planner.model.load import load_config, meta_model

    return _sized(meta_model(load_config(config)), plan, tp, dtype)
