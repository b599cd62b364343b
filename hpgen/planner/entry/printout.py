"""What ``hpgen plan`` and ``hpgen explain --config`` print besides the plan: notes and the sizing report.

Kept apart from :mod:`hpgen.cli` so that the command line imports torch and transformers
only for the commands that build a model.
"""

from __future__ import annotations

from typing import Any

from hpgen.core.errors import HpgenError

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
    pp: int | None = None,
    pp_layers: tuple[int, ...] | None = None,
) -> tuple[str, list[str]]:
    """The plan's JSON text and the messages for stderr (notes with ``notes``, the sizing report with ``tp``).

    ``pp``: pipeline stages over a ``pp`` axis outside the others, ``pp_layers`` their layer counts
    (:mod:`hpgen.planner.passes.pipeline_stages`)."""
    from hpgen.planner.entry.make import plan_model
    from hpgen.planner.model.load import load_config, meta_model
    from hpgen.planner.translate.document import dumps_plan

    model = meta_model(load_config(target))
    if pp_layers is not None and pp is None:
        raise HpgenError("--pp-layers: give --pp N too")
    if pp is not None:
        _refuse_with_pp(cp=cp, ep=ep, attn_dp=attn_dp, sp=sp)
    if attn_dp and (ep is None or sp):
        raise HpgenError("--attn-dp: give --ep N (and --tp M for attention tensor-parallel inside each group; not --sp)")
    if attn_dp and cp is not None:
        raise HpgenError("--attn-dp: not with --cp (attention cannot be data-parallel and context-parallel at once)")
    if attn_dp:
        from hpgen.planner.passes.data_parallel_attention import data_parallel_attention

        expert_plan = plan_model(model, ep=ep, ep_axis=ep_axis, from_source=from_source, name=target, summed=summed)
        tp_plan = None if tp is None else plan_model(model, tp=tp, from_source=from_source, name=target, summed=summed)
        plan = data_parallel_attention(model, expert_plan, target, tp_plan)
    elif pp is None or tp is not None or sp:
        plan = plan_model(
            model, tp=tp, ep=ep, sp=sp, ep_axis=ep_axis, from_source=from_source, name=target, summed=summed, cp=cp
        )
    else:
        plan = None  # pipeline stages alone
    cut = None
    if pp is not None:
        from hpgen.planner.passes.pipeline_stages import add_pipeline, stage_cut

        cut = stage_cut(model, pp, layers=pp_layers, name=target)
        plan = add_pipeline(plan, cut, type(model).__name__)
    plan["planned_for"] = _planned_for(plan["mesh_dim_names"], tp=tp, ep=ep, cp=cp, pp=pp)
    comments = plan.get("comments", {})
    source = comments.get("plan_source", "pipeline stages" if pp is not None and cp is None else "context parallel")
    messages = [f"{target}: {source}"]
    if cut is not None:
        from hpgen.planner.passes.pipeline_stages import stages_text

        stages = stages_text(cut.stages, cut.params if notes else None)
        messages += stages if notes else [f"  {pp} pipeline stages, decoder layers {'+'.join(map(str, cut.layers))}"]
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


def _refuse_with_pp(*, cp: int | None, ep: int | None, attn_dp: bool, sp: bool) -> None:
    """What pipeline stages do not compose with yet, refused by name."""
    for given, flag, why in (
        (sp, "--sp", "a sequence-sharded residual stream between stages is not covered yet"),
        (cp is not None, "--cp", "context parallelism inside pipeline stages is not covered yet"),
        (ep is not None, "--ep", "experts sharded by expert inside pipeline stages are not covered yet"),
        (attn_dp, "--attn-dp", "data-parallel attention inside pipeline stages is not covered yet"),
    ):
        if given:
            raise HpgenError(f"--pp: not with {flag} ({why})")


def _planned_for(
    mesh: list[str], *, tp: int | None, ep: int | None, cp: int | None, pp: int | None = None
) -> dict[str, int]:
    """Each axis's size as the command gave it (``cp``, ``pp``; ``tp``, which the experts share without
    ``--ep-axis``; the experts' own axis): recorded in the plan, so that ``parallelize`` on another mesh can say which sizes
    the plan was written for."""
    sizes = {}
    for axis in mesh:
        size = {"cp": cp, "pp": pp}.get(axis, (tp if tp is not None else ep) if axis == "tp" else ep)
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
