"""``--pp N``: the decoder layers cut into N pipeline stages, balanced by parameter count.

The stages are contiguous runs of the decoder layers (the modules transformers'
``base_model_pp_plan`` names: ``embed_tokens``, ``layers``, ``norm``, and the causal LM's
``lm_head``). The first stage also holds the embedding, the last the final norm and the
language-model head, and their parameters count toward those stages' cost, so a large
vocabulary leaves fewer layers on the first and last stages. With tied embeddings the
table is counted on both ends (Megatron and DeepSpeed keep it on both). The cut minimises
the largest stage's parameter count; ``layers`` (``--pp-layers 3,5``) overrides it.

The plan gains a ``pp`` axis outermost in ``mesh_dim_names`` and a ``pipeline`` key
(docs/plan-format.md); its entries are unchanged (they never name ``pp``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpgen.core.errors import HpgenError
from hpgen.core.plan_entries import compact_stage

__all__ = ["PIPELINE_AXIS", "StageCut", "add_pipeline", "stage_cut", "stage_params", "stages_text"]

PIPELINE_AXIS = "pp"


@dataclass(frozen=True)
class StageCut:
    """Each stage's modules (FQNs, layers expanded) and parameter count."""

    stages: tuple[tuple[str, ...], ...]
    params: tuple[int, ...]
    layers: tuple[int, ...]  # decoder layers per stage


def _pp_modules(model: Any, name: str) -> tuple[str | None, str, str | None, str | None]:
    """(embedding, layer list, final norm, lm_head) FQNs, from transformers' pipeline plans."""
    base_plan = dict(getattr(model.config, "base_model_pp_plan", None) or {})
    if "layers" not in base_plan:
        raise HpgenError(f"{name}: --pp needs transformers' base_model_pp_plan (embed_tokens, layers, norm); this config has none")
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    head = f"{prefix}." if base is not None else ""

    def fqn(key: str) -> str | None:
        return f"{head}{key}" if key in base_plan else None

    lm_head = "lm_head" if hasattr(model, "lm_head") else None
    return fqn("embed_tokens"), f"{head}layers", fqn("norm"), lm_head


def _count(module: Any, seen: set[int]) -> int:
    """Parameters of ``module`` not counted yet on this stage (a tied table counts once per stage)."""
    total = 0
    for param in module.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


def stage_cut(model: Any, pp: int, *, layers: Sequence[int] | None = None, name: str = "model") -> StageCut:
    """The stages of ``model`` (a meta-device instance) over ``pp`` ranks; ``layers``: layers per stage, chosen."""
    embed, stack, norm, lm_head = _pp_modules(model, name)
    modules = dict(model.named_modules())
    blocks = list(modules[stack]) if stack in modules else []
    n = len(blocks)
    if pp > n:
        raise HpgenError(f"{name}: --pp {pp}: {n} decoder layers ({stack}) cannot fill {pp} stages (one layer a stage at least)")
    ends = {0: [m for m in (embed,) if m in modules], pp - 1: [m for m in (norm, lm_head) if m in modules]}
    _refuse_uncovered(model, {embed, stack, norm, lm_head}, name)
    layer_cost = [_count(block, set()) for block in blocks]

    def end_cost(stage: int) -> int:
        seen: set[int] = set()
        return sum(_count(modules[m], seen) for m in ends.get(stage, []))

    if layers is not None:
        counts = list(layers)
        if len(counts) != pp or any(c < 1 for c in counts) or sum(counts) != n:
            raise HpgenError(
                f"{name}: --pp-layers {','.join(map(str, counts))}: give {pp} positive counts adding up to the {n} decoder layers"
            )
    else:
        counts = _balanced(layer_cost, [end_cost(s) for s in range(pp)])
    stages, start = [], 0
    for stage, count in enumerate(counts):
        kept = [f"{stack}.{i}" for i in range(start, start + count)]
        front = list(ends.get(0, [])) if stage == 0 else []
        back = list(ends.get(pp - 1, [])) if stage == pp - 1 else []
        stages.append(tuple(front + kept + back))
        start += count
    return StageCut(tuple(stages), stage_params(model, stages), tuple(counts))


def stage_params(model: Any, stages: Sequence[Sequence[str]]) -> tuple[int, ...]:
    """Each stage's parameter count (a table tied between two stages counts on both)."""
    modules = dict(model.named_modules())
    counts = []
    for stage in stages:
        seen: set[int] = set()
        counts.append(sum(_count(modules[m], seen) for m in stage if m in modules))
    return tuple(counts)


def _balanced(layer_cost: Sequence[int], end_cost: Sequence[int]) -> list[int]:
    """Layers per stage, contiguous, minimising the largest stage's cost (ties: earlier stages fuller)."""
    n, pp = len(layer_cost), len(end_cost)
    prefix = [0]
    for cost in layer_cost:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[s][i]: the smallest largest-stage cost of putting layers i.. on stages s..
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    choice = [[0] * (n + 1) for _ in range(pp + 1)]
    best[pp][n] = 0
    for s in range(pp - 1, -1, -1):
        for i in range(n - 1, -1, -1):
            left = pp - s - 1  # stages after this one, each needing a layer
            for j in range(i + 1, n - left + 1):
                cost = max(prefix[j] - prefix[i] + end_cost[s], best[s + 1][j])
                if cost < best[s][i] or (cost == best[s][i] and j > choice[s][i]):
                    best[s][i], choice[s][i] = cost, j
    counts, i = [], 0
    for s in range(pp):
        j = choice[s][i]
        counts.append(j - i)
        i = j
    return counts


def _refuse_uncovered(model: Any, covered: set[str | None], name: str) -> None:
    """Modules with parameters outside the embedding, layers, norm and head (a vision tower): not staged yet."""
    for fqn, module in model.named_modules():
        if not fqn or any(fqn == c or fqn.startswith(c + ".") or c.startswith(fqn + ".") for c in covered if c):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            raise HpgenError(
                f"{name}: --pp: {fqn} has parameters outside the embedding, decoder layers, norm and lm_head; "
                "pipeline stages cover those only"
            )


def add_pipeline(document: Mapping[str, Any] | None, cut: StageCut, model_class: str | None = None) -> dict[str, Any]:
    """The plan document with ``pp`` outermost and the stages; ``document`` None: a pipeline-only plan
    (naming ``model_class``, so that ``hpgen verify`` and ``lower`` know the root class)."""
    plan = dict(document) if document is not None else {"format": "hpgen.plan/1", "mesh_dim_names": [], "param_plan": {}}
    if document is None and model_class is not None:
        plan["model_class"] = model_class
    plan["mesh_dim_names"] = [PIPELINE_AXIS, *plan["mesh_dim_names"]]
    plan["pipeline"] = {"axis": PIPELINE_AXIS, "stages": [compact_stage(stage) for stage in cut.stages]}
    return plan


def stages_text(stages: Sequence[Sequence[str]], params: Sequence[int] | None = None) -> list[str]:
    """One line a stage: its modules, and its parameter count where known (``--explain``, ``hpgen explain``)."""
    lines = []
    for index, stage in enumerate(stages):
        count = f" ({params[index]:,} parameters)" if params is not None else ""
        lines.append(f"  pipeline stage {index}: {', '.join(compact_stage(stage))}{count}")
    return lines
