"""Coverage of ``hpgen plan`` over the installed transformers: plan, lower, 2-rank parity.

    python benchmarks/coverage.py                      # every architecture, resuming earlier results
    python benchmarks/coverage.py --sp                 # the --sp plans (the SP column), where TP passed
    python benchmarks/coverage.py --ep                 # --ep 2 plans (the EP column), MoE models where TP passed
    python benchmarks/coverage.py --only llama,qwen3   # some model types (their rows are redone; the page is
                                                       # rewritten only when the results hold every model type)
    python benchmarks/coverage.py --fresh              # forget earlier results of this variant
    python benchmarks/coverage.py --render             # only rewrite docs/coverage.md from the results
    python benchmarks/coverage.py --train --only gpt2,opt  # the train-mode column (its own section of the page)

For every model type that has a causal-LM class (transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING``),
with or without a ``base_model_tp_plan``:

1. **plan**: a tiny config of the architecture (:func:`hpgen.verify.shrink.tiny_config`, which
   ``hpgen verify`` uses too, with its ``CONFIG_FIXES`` for the few whose config needs one more
   change to be valid), the model on the meta device, and
   :func:`hpgen.planner.entry.make.plan_model` with ``tp=2`` (and ``sp=True`` with ``--sp``, ``ep=2`` with
   ``--ep``: whole experts per rank, for the models that have an expert plan):
   transformers' plan where it shards the decoder layers, otherwise the plan derived from the
   modeling source (the ``plan source`` column);
2. **lower**: ``hpgen.generator.lower.lower`` of the file the model class comes from, under that
   plan (relative imports made absolute, so the generated file imports from anywhere);
3. **parity** (decoder-only causal LMs): two gloo ranks on the CPU each build the
   transformers model from the tiny config with seeded, perturbed weights (transformers
   initialises norms to one and biases to zero, which would hide a bias added twice), the
   same model from the generated file with those weights, ``parallelize`` it over the two
   ranks, and compare logits (tolerance 1e-5 + 1e-4 * max|logits|, as the runtime tests)
   and every parameter's gradient (this rank's slice of the reference gradient; a bias against
   its layer's gradient scale, as a key bias's gradient is zero but for rounding). The
   causal LMs of composite models and BERT-style decoders count too (``GPT2LMHeadModel``,
   ``BertLMHeadModel`` with ``is_decoder``); a tiny config still over ``MAX_PARAMS`` is not run.

With ``--train`` (the train-mode check, for the model types whose config has dropout): every
``*drop*`` probability of the config set to 0.1, ranks seeded ``torch.manual_seed(1234 + rank)``,
the parallelized model in train mode takes 3 AdamW steps on one batch, and every parameter the
plan keeps replicated must be the same on both ranks, bit for bit (:func:`_train_rank`). Its
results go to their own section of the page, between ``TRAIN_BEGIN`` and ``TRAIN_END``.

The ranks run several architectures per spawn (``--chunk``), each case bounded by
``--timeout`` seconds; a spawn that fails as a whole is retried one architecture at a time.
A result line is appended to ``<--results>/hpgen-coverage-<tp|sp|ep>.jsonl`` (default: the
system temporary folder) as soon as it is known, so an interrupted run resumes where it
stopped. The page ``docs/coverage.md`` is rendered from those files.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hpgen.verify.shrink import all_configs, tiny_config  # noqa: E402 - the tiny configs hpgen verify runs on too

TABLE = REPO / "docs" / "coverage.md"
SEED = 0
# The tiny shape's odd sizes (89) give rows of 356 bytes, which transformers' default experts
# kernel (grouped_mm) refuses ("strides should be multiple of 16 bytes"); where the unsharded
# model fails so, the case is run once more with this size, even per rank as well.
KERNEL_SHAPE = {"intermediate_size": 96}

# Models compared in train mode, with these config changes: Reformer's reversible layers run their
# backward only in train mode (transformers asserts it). There its dropout is off, and transformers
# requires the axial position shape to multiply to the sequence length (7 tokens) and the sequence to be
# a multiple of the attention chunks. Its LSH attention draws random rotations in every forward; both
# forwards start from the same seed, and the plan keeps the attention replicated (the rotations have the
# same shapes on every rank), so the draws match.
TRAIN_MODE: dict[str, dict[str, Any]] = {
    "reformer": {
        "hidden_dropout_prob": 0.0,
        "local_attention_probs_dropout_prob": 0.0,
        "lsh_attention_probs_dropout_prob": 0.0,
        "axial_pos_shape": (7, 1),
        "lsh_attn_chunk_length": 7,
        "local_attn_chunk_length": 7,
    },
}
MAX_PARAMS = 60_000_000
TARGET_SHARE = 0.65  # "layers sharded": each rank holds at most this share of the parameters


def is_decoder_only_causal_lm(cls: type, config: Any) -> bool:
    """Whether parity runs: transformers' causal-LM class of the type, not half of an encoder-decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) | {
        name for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() if isinstance(value, tuple) for name in value
    }
    return (cls.__name__.endswith("ForCausalLM") or cls.__name__ in causal) and not getattr(
        config, "is_encoder_decoder", False
    )


# --------------------------------------------------------------------------- one architecture


@dataclasses.dataclass
class Row:
    """The coverage of one model type."""

    model_type: str
    model_class: str = ""
    plan_ok: bool = False
    lower_ok: bool = False
    parity: bool | None = None  # None: not run (not a decoder-only causal LM, or an earlier step failed)
    logits_err: float | None = None
    logits_tol: float | None = None
    grads_ok: bool | None = None
    param_share: float | None = None  # the largest rank's parameter bytes / the unsharded model's
    layers_sharded: bool | None = None  # some parameter inside the decoder layers is sharded
    plan_source: str = ""  # "transformers' plan" or "derived from the source" (hpgen.planner.entry.make)
    replicated: str = ""  # what a derived plan left replicated in the layers, and why (its first notes)
    reason: str = ""
    seconds: float = 0.0  # planning and lowering in the parent process
    wall: float = 0.0  # this row's share of its chunk's wall time (plan, lower, the ranks' spawn); summed: the run's


@dataclasses.dataclass(frozen=True)
class Case:
    """One architecture ready for the parity run: its generated file and plan."""

    model_type: str
    generated: str
    plan: dict
    others: tuple[str, ...] = ()  # the generated files of the other modeling files the boundaries live in


VARIANTS = {"tp": {}, "sp": {"sp": True}, "ep": {"ep": 2}, "train": {}}  # translated_plan options beyond tp=2
TRAIN_DROPOUT = 0.1
TRAIN_STEPS = 3
TRAIN_BEGIN, TRAIN_END = "<!-- train-mode: begin -->", "<!-- train-mode: end -->"
HEADS_BEGIN, HEADS_END = "<!-- heads: begin -->", "<!-- heads: end -->"  # benchmarks/coverage_heads.py's section


def dropout_keys(config: Any) -> list[str]:
    """The config's dropout probabilities (``attention_dropout``, ``resid_pdrop``, ...), in its text config too."""
    found = []
    for part in all_configs(config):
        found += [
            key for key, value in vars(part).items()
            if "drop" in key.lower() and isinstance(value, float) and not key.startswith("_")
        ]  # fmt: skip
    return sorted(set(found))


def prepare(model_type: str, directory: Path, *, variant: str = "tp") -> tuple[Row, Case | None]:
    """Plan and lower one architecture; the case to compare on ranks when it is a causal LM."""
    from hpgen.core.errors import HpgenError
    from hpgen.generator.generate import infer_package
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.model.load import meta_model, model_and_config
    from hpgen.planner.entry.make import plan_model, plan_source

    row = Row(model_type)
    started = time.monotonic()
    try:
        try:
            cls, config = model_and_config(tiny_config(model_type))
        except HpgenError as error:
            row.reason = f"config: {error}"
            return row, None
        except Exception as error:  # transformers cannot build this architecture's config
            row.reason = f"config: {_short(error)}"
            return row, None
        row.model_class = cls.__name__
        if variant == "train" and not dropout_keys(config):
            row.reason = "train mode not run: the config has no dropout"
            return row, None
        try:
            model = meta_model(config)
            row.plan_source = plan_source(model)
            plan = plan_model(model, tp=2, name=model_type, **VARIANTS[variant])
        except HpgenError as error:
            row.reason = f"plan: {error}"
            return row, None
        notes = plan.get("comments", {}).get("replicated", {})
        row.replicated = "; ".join(f"`{key}`: {text}" for key, text in list(notes.items())[:2])
        row.plan_ok = True
        source = Path(inspect.getsourcefile(cls) or "")
        # `hpgen lower` is one file in, one file out: each modeling file the boundaries live in is lowered
        others = [
            Path(importlib.util.find_spec(name).origin)
            for name in plan.get("comments", {}).get("modeling_files", [])
            if Path(importlib.util.find_spec(name).origin).resolve() != source.resolve()
        ]
        texts = []
        try:
            for path in (source, *others):
                texts.append(
                    lower(
                        path.read_text(encoding="utf-8"),
                        plan_from_dict(plan, name=f"{model_type}.json"),
                        source_name=path.name,
                        package=infer_package(path),
                    )
                )
        except HpgenError as error:
            row.reason = f"lower: {error}"
            return row, None
        text = texts[0]
        row.lower_ok = True
        if not is_decoder_only_causal_lm(cls, getattr(model, "config", config)):  # BartForCausalLM: a decoder
            row.reason = "parity not run: not a decoder-only causal LM"
            return row, None
        size = sum(param.numel() for param in model.parameters())
        if size > MAX_PARAMS:  # two ranks, each holding the reference and the parallel copy, on a shared CPU
            row.reason = f"parity not run: the tiny config still has {size / 1e6:.0f}M parameters (sizes the tiny shape does not reach)"
            return row, None
        generated = directory / f"{model_type}_{variant}.py"
        generated.write_text(text, encoding="utf-8")
        written = []
        for path, other in zip(others, texts[1:]):
            written.append(directory / f"{model_type}_{variant}_{path.stem}.py")
            written[-1].write_text(other, encoding="utf-8")
        return row, Case(model_type, str(generated), plan, tuple(map(str, written)))
    finally:
        row.seconds = round(time.monotonic() - started, 1)


def compare(cases: list[Case], timeout: float, variant: str = "tp") -> dict[str, dict | str]:
    """Run the cases on 2 ranks in one spawn; per model type its rank results or an error line.

    Every rank catches a case's exception and meets the other at a barrier before the next
    case, so a failure that both ranks hit (nearly all: the ranks run the same code) costs
    one case. A run that still fails as a whole (a rank stuck in a collective the other
    left) is retried one case per spawn.
    """
    from tests.support.dist import RankFailed, run_distributed

    try:
        ranks = run_distributed(_rank_cases, cases, SEED, variant, timeout=timeout * len(cases))
    except RankFailed as failure:
        if len(cases) == 1:
            return {cases[0].model_type: _rank_error(failure)}
        found: dict[str, dict | str] = {}
        for case in cases:
            found.update(compare([case], timeout, variant))
        return found
    found = {}
    for case in cases:
        outcomes = [by_case[case.model_type] for by_case in ranks]
        errors = [outcome for outcome in outcomes if isinstance(outcome, str)]
        found[case.model_type] = errors[0] if errors else {"ranks": outcomes}
    return found


def finish(row: Row, outcome: dict | str) -> Row:
    """Fill in the parity columns from one case's outcome."""
    if isinstance(outcome, str):
        row.parity = False
        row.reason = f"parity: {outcome}"
        return row
    if "replicated" in outcome["ranks"][0]:  # the train-mode check
        differ = sorted({name for result in outcome["ranks"] for name in result["differ"]})
        count = outcome["ranks"][0]["replicated"]
        if not count:
            row.reason = "train mode not compared: the plan keeps no parameter replicated"
            return row
        row.parity = row.grads_ok = not differ
        row.reason = f"{len(differ)} of {count} replicated parameters differ: " + ", ".join(differ[:3]) if differ else (
            f"{count} replicated parameters equal on both ranks after {TRAIN_STEPS} steps"
        )
        return row
    results = outcome["ranks"]
    worst = max(results, key=lambda result: result["logits_err"] / max(result["logits_tol"], 1e-30))
    row.logits_err, row.logits_tol = worst["logits_err"], worst["logits_tol"]
    row.param_share = max(result["param_share"] for result in results)
    row.layers_sharded = all(result["layers_sharded"] for result in results)
    shape = results[0].get("shape")
    row.parity = all(result["logits_err"] <= result["logits_tol"] for result in results)
    grad_failures = sorted({failure for result in results for failure in result["grad_failures"]})
    row.grads_ok = not grad_failures
    reasons = []
    if not row.parity:
        reasons.append(f"logits differ: {row.logits_err:.3g} > {row.logits_tol:.3g}")
    if grad_failures:
        reasons.append(f"gradients differ ({len(grad_failures)}): " + "; ".join(grad_failures[:3]))
    if shape:
        reasons.append(f"run with {shape}: transformers' grouped_mm kernel needs 16-byte strides")
    row.reason = "; ".join(reasons)
    return row


def _rank_cases(rank: int, world_size: int, cases: list[Case], seed: int, variant: str = "tp") -> dict[str, dict | str]:
    """Rank body: each case's result, or the last line of its traceback; a barrier between cases."""
    import torch.distributed as dist

    found: dict[str, dict | str] = {}
    body = _train_rank if variant == "train" else _parity_rank
    for case in cases:
        try:
            found[case.model_type] = body(rank, world_size, case.model_type, case.generated, case.plan, seed, case.others)
        except Exception:  # recorded per case; the next case still runs
            found[case.model_type] = _last_line(traceback.format_exc())
        dist.barrier()
    return found


def _parity_rank(
    _rank: int, world_size: int, model_type: str, generated: str, plan: dict, seed: int, others: tuple[str, ...] = ()
) -> dict:
    """One rank: the reference and the parallelized generated model, their logits and gradients.

    This rank's place on each mesh axis comes from the mesh (``_rank`` is its global rank).
    ``others`` are the generated files of the other modeling files the plan's boundaries live
    in (a language model built through ``AutoModel``): ``parallelize`` takes its classes from them.
    """
    import torch
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.planner.model.load import model_and_config
    from hpgen.runtime import parallelize
    from tests.support.models import expected_shard, import_file, param_layouts, perturb_, tolerance

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=tuple(plan["mesh_dim_names"]))
    generator = torch.Generator().manual_seed(seed + 1)
    ids = None
    for shape in (None, KERNEL_SHAPE):
        cls, config = model_and_config(tiny_config(model_type, shape))
        for key, value in TRAIN_MODE.get(model_type, {}).items():
            setattr(config, key, value)
        torch.manual_seed(seed)
        reference = cls(config)
        perturb_(reference, seed)
        reference.train(model_type in TRAIN_MODE)
        _default_language(reference, config)
        if ids is None:
            ids = torch.randint(0, config.get_text_config().vocab_size, (2, 7), generator=generator)
        try:
            torch.manual_seed(seed + 2)  # the same random draws in both forwards (train mode: LSH rotations)
            ref_logits = reference(input_ids=ids).logits
            break
        except RuntimeError as error:  # grouped_mm's 16-byte strides: the odd tiny sizes, not the model
            if shape is not None or "multiple of 16 bytes" not in str(error):
                raise ReferenceFailed(f"transformers' own model fails on the tiny config: {_short(error)}") from error
        except Exception as error:  # the tiny config, not hpgen: transformers' own model fails
            raise ReferenceFailed(f"transformers' own model fails on the tiny config: {_short(error)}") from error
    if not torch.isfinite(ref_logits).all():
        raise ReferenceFailed("transformers' own model gives non-finite logits on the tiny config")
    generated_class = getattr(import_file(generated), cls.__name__)
    torch.manual_seed(seed)  # the same non-persistent buffers as the reference (some are drawn at random)
    model = generated_class(config)
    _default_language(model, config)
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    if missing or unexpected:
        raise AssertionError(f"state_dict keys differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.train(model_type in TRAIN_MODE)
    full_shapes = {name: param.shape for name, param in model.named_parameters()}
    full_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
    parallelize(model, plan, mesh, generated=[import_file(path) for path in others])
    local_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
    # a parameter of a decoder layer (a numbered segment: model.layers.3.mlp...) got smaller
    layers_sharded = any(
        param.shape != full_shapes[name] and any(part.isdigit() for part in name.split("."))
        for name, param in model.named_parameters()
    )

    torch.manual_seed(seed + 2)
    logits = model(input_ids=ids).logits
    projection = torch.randn(ref_logits.shape, generator=generator)
    (ref_logits * projection).sum().backward()
    (logits * projection).sum().backward()

    layouts = param_layouts(reference, plan)
    axes = [
        (axis, mesh.get_local_rank(axis), mesh.size(mesh.mesh_dim_names.index(axis))) for axis in plan["mesh_dim_names"]
    ]
    failures = []
    mine = dict(model.named_parameters())
    # A bias is held to its layer's gradient scale: some are zero but for rounding (a key projection's
    # bias: the softmax ignores a shift shared by all keys), and rounding differs between the two sums.
    refs = dict(reference.named_parameters())
    scale = {
        name: refs[name[: -len("bias")] + "weight"].grad
        for name in refs
        if name.endswith(".bias") and refs.get(name[: -len("bias")] + "weight") is not None
        and refs[name[: -len("bias")] + "weight"].grad is not None
        and refs[name].grad is not None
        and refs[name[: -len("bias")] + "weight"].grad.abs().max() > refs[name].grad.abs().max()
    }
    for name, ref_param in reference.named_parameters():
        if ref_param.grad is None:
            continue  # unused in this forward (e.g. an MTP head)
        param = mine.get(name)
        if param is None or param.grad is None:
            failures.append(f"{name}: no gradient")
            continue
        want = ref_param.grad
        for axis, coordinate, size in axes:  # each axis splits what the previous ones left, in mesh order
            want = expected_shard(want, layouts.get(name, {}).get(axis, "R"), coordinate, size)
        err, tol = (param.grad - want).abs().max().item(), tolerance(scale.get(name, ref_param.grad))
        if not err <= tol:
            failures.append(f"{name}: {err:.3g} > {tol:.3g}")
    return {
        "logits_err": (logits - ref_logits).abs().max().item(),
        "logits_tol": tolerance(ref_logits),
        "grad_failures": failures,
        "param_share": local_bytes / full_bytes,
        "layers_sharded": layers_sharded,
        "shape": shape,
    }


def _train_rank(
    rank: int, world_size: int, model_type: str, generated: str, plan: dict, seed: int, others: tuple[str, ...] = ()
) -> dict:
    """One rank of the train-mode check: dropout 0.1, this rank's own seed, 3 AdamW steps; then the
    replicated parameters of both ranks compared bit for bit."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from hpgen.planner.model.load import model_and_config
    from hpgen.runtime import parallelize
    from tests.support.models import import_file, perturb_

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=tuple(plan["mesh_dim_names"]))
    generator = torch.Generator().manual_seed(seed + 1)
    for shape in (None, KERNEL_SHAPE):
        cls, config = model_and_config(tiny_config(model_type, shape))
        for part in all_configs(config):
            for key in dropout_keys(part):
                if key in vars(part):
                    setattr(part, key, TRAIN_DROPOUT)
        torch.manual_seed(seed)
        model = getattr(import_file(generated), cls.__name__)(config)
        perturb_(model, seed, scale=0.02)
        _default_language(model, config)
        full_shapes = {name: param.shape for name, param in model.named_parameters()}
        ids = torch.randint(0, config.get_text_config().vocab_size, (2, 7), generator=generator)
        torch.manual_seed(1234 + rank)  # as data-loading code commonly does
        parallelize(model, plan, mesh, generated=[import_file(path) for path in others])
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        try:
            for _ in range(TRAIN_STEPS):
                logits = model(input_ids=ids).logits
                F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            break
        except RuntimeError as error:  # grouped_mm's 16-byte strides on the odd tiny sizes: once more, even
            if shape is not None or "multiple of 16 bytes" not in str(error):
                raise
    differ = []
    replicated = [(name, param) for name, param in model.named_parameters() if param.shape == full_shapes[name]]
    for name, param in replicated:
        pieces = [torch.empty_like(param) for _ in range(world_size)]
        dist.all_gather(pieces, param.detach().contiguous())
        if not all(torch.equal(piece, pieces[0]) for piece in pieces):
            differ.append(name)
    return {"replicated": len(replicated), "differ": differ}


def render_train(rows: dict[str, Row], architectures_found: list[str]) -> str:
    """The train-mode section of the page (between TRAIN_BEGIN and TRAIN_END)."""
    ran = [rows[name] for name in architectures_found if name in rows and rows[name].parity is not None]
    passed = [row for row in ran if row.parity]
    lines = [
        TRAIN_BEGIN,
        "## Train mode",
        "",
        "`python benchmarks/coverage.py --train --only ...`" + (f" ({_minutes(rows)})" if _minutes(rows) else "")
        + ": for model types whose config has dropout, every `*drop*`"
        f" probability set to {TRAIN_DROPOUT}, the 2 ranks seeded `torch.manual_seed(1234 + rank)`, the parallelized"
        f" model (plan of `hpgen plan --tp 2`) in train mode takes {TRAIN_STEPS} AdamW steps, then every parameter"
        " the plan keeps replicated must be the same on both ranks, bit for bit (dropout on replicated and partial"
        " values draws one stream on every rank).",
        "",
        f"- run for **{len(ran)}** model types (those at parity in the tensor-parallel table whose config has"
        f" dropout); replicated parameters equal on both ranks for **{len(passed)}** of them",
        "",
        "| model type | model class | train mode | detail |",
        "|---|---|---|---|",
    ]
    for row in ran:
        lines.append(f"| {row.model_type} | {row.model_class} | {_mark(row.parity)} | {_cell(row.reason)} |")
    lines.append(TRAIN_END)
    return "\n".join(lines) + "\n"


def _with_train_section(page: str, section: str) -> str:
    """``page`` with its train-mode section replaced by ``section`` (appended when it has none)."""
    return with_section(page, section, TRAIN_BEGIN, TRAIN_END)


def with_section(page: str, section: str, begin: str, end: str) -> str:
    """``page`` with its section between ``begin`` and ``end`` replaced by ``section`` (appended when it has none)."""
    if begin in page and end in page:
        before, rest = page.split(begin, 1)
        return before + section + rest.split(end, 1)[1].lstrip("\n")
    return page.rstrip("\n") + "\n\n" + section


def section_of(page: str, begin: str, end: str) -> str:
    """The section of ``page`` between ``begin`` and ``end``, markers included ('' when it has none)."""
    if begin not in page or end not in page:
        return ""
    return begin + page.split(begin, 1)[1].split(end, 1)[0] + end + "\n"


def _default_language(model: Any, config: Any) -> None:
    """X-MOD runs per-language adapters and needs one chosen (transformers' own API for it)."""
    languages = getattr(config, "languages", None)
    if hasattr(model, "set_default_language") and languages:
        model.set_default_language(list(languages)[0])


class ReferenceFailed(RuntimeError):
    """transformers' unsharded model itself fails on the tiny config (a config problem, not hpgen's)."""


def _short(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300]}" if lines else type(error).__name__


def _rank_error(failure: Exception) -> str:
    """The last line of the first failed rank's traceback (the exception and its message)."""
    failures = getattr(failure, "failures", {})
    text = next(iter(failures.values()), str(failure)) if failures else str(failure)
    return _last_line(text)


def _last_line(text: str) -> str:
    """The exception line of a traceback text."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if not line.startswith((" ", "\t")) and ("Error" in line or "Exception" in line or "failed" in line):
            return line.strip()[:400]
    return (lines[-1] if lines else "no output").strip()[:400]


# --------------------------------------------------------------------------- the run and the table


def architectures() -> list[str]:
    """Every model type of the installed transformers that has a causal-LM class (with or without a tp_plan)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def results_path(folder: Path, variant: str) -> Path:
    return folder / f"hpgen-coverage-{variant}.jsonl"


def load_results(path: Path) -> dict[str, Row]:
    """The rows of a results file; a model type's later line wins (reruns append)."""
    rows: dict[str, Row] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                data = json.loads(line)
                rows[data["model_type"]] = Row(**data)
    return rows


# Failures whose cause was found by hand, each checked by changing exactly that one thing.
NOTES: dict[str, str] = {
    "inkling_text": "the `colwise` on the packed `experts.gate_up_proj` (transformers' plan up to 5.24; from 5.25, "
    "whose plan leaves the experts and shared experts out, hpgen's rules read from their weights' shapes) is "
    "corrected to SS(1,2) (the experts split it with `chunk(2)`), and the shared experts' gating weights "
    "(`gammas`, a second input of the sharded block) are declared R -> R so their gradient is reduced; the "
    "attention, which transformers' plan leaves replicated, is completed from the source: q/k/v/r columns, the "
    "short convolutions on k and v sharded with their channels, the relative-logits matrix (the same map for "
    "each head) replicated with its gradient reduced.",
    "inkling2_text": "the `colwise` on the packed `experts.gate_up_proj` (transformers' plan up to 5.24, hpgen's "
    "rule read from the weights' shapes from 5.25) is corrected to SS(1,2) (`_apply_gate` splits it with "
    "`chunk(2)`); transformers' plan shards only the experts, and the attention is "
    "completed from the source: the q/k/v/relative/sink/gate projections as columns, the short convolutions "
    "(static and dynamic taps) and the per-head L2-clip scales sharded with their heads, the relative-position "
    "matrix (the same map for each head) replicated with its gradient reduced.",
    "inkling2_loop_text": "as inkling2_text: the experts by transformers' plan, the attention completed from the "
    "source.",
    "gemma3n_text": "the MLP's activation sparsity (`_gaussian_topk`: mean and std over the intermediate "
    "features) would run on the colwise-sharded intermediate, so hpgen keeps the MLPs of the sparse layers "
    "(`activation_sparsity` > 0: two of the tiny config's four) replicated and shards the others; with the "
    "per-layer input embeddings and AltUp projections replicated too, a rank holds more than 0.65.",
    "gemma3": "the language model, built through `AutoModel`, takes the generated classes; transformers' plan "
    "shards only the language model: the SigLIP vision tower (from modeling_siglip.py through `AutoModel`, 147k of "
    "the tiny model's 219k parameters) and the projector stay replicated, and the derivation that completes "
    "transformers' plans reads only the model's own modeling file.",
    "got_ocr2": "Qwen2's decoder layers are lowered from modeling_qwen2.py; the multi-modal projector "
    "(convolutions, 1.5M of the tiny model's 3.3M parameters) and the vision tower's attention stay replicated.",
    "moss_transcribe_diarize": "Qwen3's decoder layers are lowered from modeling_qwen3.py; the audio tower (181k of "
    "the tiny model's 269k parameters, from its own file through `AutoModel`) is mostly replicated.",
    "gemma4_unified_assistant": "the assistant (a drafter) runs on the target model's `inputs_embeds` and "
    "`shared_kv_states`, and transformers raises without them: it does not run on input ids alone. Its plan "
    "names modeling_gemma4_unified.py, the file of its layers, which is lowered with it.",
    "fuyu": "the language model is Persimmon's, built through `AutoModel` from another modeling file: the "
    "derivation reads that file and shards its MLP as wrapped `nn.Linear`s, but the attention's per-head "
    "`q_layernorm`/`k_layernorm` need a block (a class of the lowered file) to reduce their gradients in; most "
    "of the parameters at the tiny config are the vision patch projection `vision_embed_tokens` (64 x 2700), "
    "which the text-only causal LM never runs.",
    "bitnet": "`attn_sub_norm` / `ffn_sub_norm` normalise the whole sharded width between the projections. The "
    "honest boundary (all-gather into the sub-norm, split after it) was tried: with the MLP alone it is at parity "
    "(share 0.67), but with both, the MLP's gather of its 89 features (45 + 44) takes its shard sizes from the "
    "attention's split of 64 earlier in the forward (the runtime keeps one size record per dim) and stops; the "
    "generated gather would need the total size, so both pairs stay replicated.",
    "dory": "as bitnet, its L2 `attn_sub_norm` / `ffn_sub_norm` sit between the projections. With the MLP sharded "
    "through a gathered sub-norm the gradients match to 1e-16 in float64, but its looped layers "
    "(`n_recurrent_loops`) amplify the float32 rounding of the row-parallel sums past the tolerance. The plan "
    "now splits `mlp.down_proj`'s replicated input (a split row, 89 -> 64) and meets the same: in float64 the logits "
    "and every gradient match exactly, in float32 they do not (its gradients reach ~1e4).",
    "dbrx": "most parameters are the experts (`ffn.experts.mlp.w1`/`v1`/`w2`, 2-D [E * I, H] viewed per expert), "
    "which the derivation has no rule for, and their eager loop has no sentinel id to skip, so `experts_parallel` "
    "cannot run them; the fused `Wqkv` packs unequal blocks [64, 32, 32], which SS (equal blocks) does not cut.",
    "jetmoe": "its experts (`JetMoeParallelExperts`, 3-D, in the MLP and in the mixture-of-attention "
    "`self_attention.experts`) are not a layout the derivation shards; `kv_proj` feeds every attention expert.",
    "rwkv": "the time-mix attention writes its per-channel recurrent state into `state`, which RwkvModel allocates "
    "at the full width for generation; shards of key/value/receptance could not be written back, so the attention "
    "stays replicated (the feed-forward shards).",
    "trocr": "`TrOCRAttention` reshapes its output to `embed_dim` read from `hidden_states.size()`, not from an "
    "attribute hpgen could divide, so a shard of the heads cannot be reshaped.",
    "prophetnet": "its relative position buckets are not per head (no cut needed), but `relative_pos_embeddings` "
    "packs [buckets, heads] with the heads last, which the derivation does not recognise (SS(0, buckets) would "
    "cut it), and, as in trocr, both attentions reshape their output to `hidden_size` read from "
    "`hidden_states.size()`, which a shard of the heads does not have.",
    "gpt_oss": "the experts stay replicated (0.76 of the tiny model): `GptOssExperts` adds `down_proj_bias[e]` to each "
    "expert's output before the routing weight multiplies it (`(h @ down_proj[e] + down_proj_bias[e]) * w`), so a "
    "row split of `down_proj` needs that bias on one rank only; no placement says so (`R` adds it on every rank, a "
    "deferred bias adds it after the reduction without the routing weights). The interleaved gate/up columns "
    "(`gate_up[..., ::2]`, `[..., 1::2]`) also keep their pairs whole under `S(2)` only when 2 x intermediate / tp is "
    "even (the tiny 89 splits 178 columns 89 + 89, cutting a pair).",
    "phi4_multimodal": "0.97 of the tiny model is the audio encoder (24 conformer blocks whose `ext_pw_out_channel` and "
    "`nemo_conv_channels`, 1024, the common tiny shape does not reach): chains of `nn.Conv1d` (pointwise, GLU, "
    "depthwise) that the planner does not pair (it pairs `nn.Linear`/`Conv1D`), and the causal LM's text forward does "
    "not run the audio encoder, so no parity check would see their shards. The text layers (0.5%) and the encoders' "
    "attention and feed-forward blocks are sharded.",
    "reformer": "compared in train mode (its reversible layers run their backward only there; see TRAIN_MODE): "
    "at parity, but the attention stays replicated (the derivation: the shared query/key projection of LSH "
    "attention needs its input whole).",
}


# Models whose decoder layers hpgen does not shard: they come from another file through AutoModel, and the
# plan derived from the source reads the model's own file only.
COMPOSITE = {"fuyu"}


# Sequence-parallel failures whose cause was found by reading the model's forward.
SP_NOTES: dict[str, str] = {
    "llama4_text": "Llama4TextMoe returns its output flattened to [tokens, hidden]; the plan gathers and splits "
    "the MoE block on dim 1, which is the sequence only in [batch, sequence, hidden].",
    "llama4": "as llama4_text (the same text model).",
    "deepseek_v4": "DeepseekV4HyperConnection, a child of the decoder layer, returns three per-position tensors; "
    "the plan gathers its input and splits only the first output, so `collapsed` reaches the attention whole.",
    "hy_v4": "as deepseek_v4: a hyper-connection child returns several per-position tensors and only the first "
    "is split back.",
}


def render(variants: dict[str, dict[str, Row]], architectures_found: list[str]) -> str:
    """The markdown page: counts, one row per architecture, failures grouped, notes."""
    import transformers

    from hpgen.planner.entry.make import DERIVED, TRANSFORMERS

    rows, sp_rows, ep_rows = variants["tp"], variants.get("sp", {}), variants.get("ep", {})
    ordered = [rows[name] for name in architectures_found if name in rows]
    compared = [row for row in ordered if row.parity is not None]
    runnable = [row for row in ordered if not transformers_fails(row)]
    runs = (("TP", rows), ("SP", sp_rows), ("EP", ep_rows))
    walls = ", ".join(f"{name} {_minutes(found)}" for name, found in runs if _minutes(found))
    lines = [
        "# `hpgen plan` coverage",
        "",
        "Generated by `python benchmarks/coverage.py`" + (f" (wall time: {walls})" if walls else "")
        + f" against transformers {transformers.__version__}"
        " (torch CPU, 2 gloo ranks). For every model type that has a causal-LM class, with or without a"
        " `base_model_tp_plan`: a tiny config (hidden 64, 4 heads of 16, 2 KV heads, vocabulary 127,"
        " intermediate 89, 4 experts with 2 routed, one layer of each kind the default config has), `hpgen plan"
        " --tp 2` on the meta device (transformers' plan where it shards the decoder layers, otherwise the plan"
        " derived from the modeling source), `hpgen lower` of the model's modeling file, and for decoder-only"
        " causal LMs the generated model, parallelized over 2 ranks, against transformers' unsharded model with"
        " the same perturbed weights: logits within 1e-5 + 1e-4 * max|logits|, and every parameter's gradient"
        " (this rank's slice) within the same tolerance of the reference gradient (a bias against the scale of"
        " its layer's gradients: a key projection's bias has a gradient that is zero but for rounding). The SP"
        " column runs `hpgen plan --tp 2 --sp` the same way, the EP column `hpgen plan --tp 2 --ep 2` (whole experts"
        " per rank) for the models with an expert plan.",
        "",
        f"- causal-LM model types: **{len(architectures_found)}**; plan written: **{sum(r.plan_ok for r in ordered)}**;"
        f" lowered: **{sum(r.lower_ok for r in ordered)}**; compared on 2 ranks: **{len(compared)}**",
        f"- **at parity with the decoder layers sharded** (logits and every gradient equal, each rank holding at most"
        f" {TARGET_SHARE} of the parameters): **{sum(at_target(r) for r in ordered)}** of {len(architectures_found)}",
    ]
    for source in (TRANSFORMERS, DERIVED):
        group = [r for r in ordered if r.plan_source == source]
        if group:
            lines.append(
                f"  - {source}: **{sum(at_target(r) for r in group)}** of {len(group)} (at parity but a rank holds more"
                f" than {TARGET_SHARE}, or the layers are not sharded: "
                f"{sum(bool(r.parity and r.grads_ok) and not at_target(r) for r in group)})"
            )
    lines += [
        f"- of the {len(runnable)} types whose unsharded model transformers itself builds and runs on the tiny"
        f" config: **{sum(at_target(r) for r in runnable)}** "
        f"({100 * sum(at_target(r) for r in runnable) / max(len(runnable), 1):.0f}%)",
        "- transformers' defaults throughout (sdpa attention, the grouped_mm experts kernel); the share column is"
        " the largest rank's parameter bytes over the unsharded model's, `(emb)` when nothing inside the decoder"
        " layers is sharded",
    ]
    if sp_rows:
        tried = [row for name, row in sp_rows.items() if rows.get(name) and rows[name].parity]
        passed = sum(bool(row.parity and row.grads_ok) for row in tried)
        refused = sum(not row.plan_ok for row in tried)
        failed = sum(row.plan_ok and not (row.parity and row.grads_ok) for row in tried)
        lines.append(
            f"- with `--sp`, run where the tensor-parallel plan passes ({len(tried)}): logits and every gradient "
            f"equal for **{passed}**; plan refused for {refused}, parity failed for {failed} (listed at the end)"
        )
    if ep_rows:
        tried = [row for name, row in ep_rows.items() if rows.get(name) and rows[name].parity]
        passed = sum(bool(row.parity and row.grads_ok) for row in tried)
        lines.append(
            f"- with `--ep 2`, run for the MoE models whose tensor-parallel plan passes ({len(tried)}): logits and "
            f"every gradient equal for **{passed}**"
            + "".join(f"; {row.model_type}: {_cell(row.reason, 200)}" for row in tried if not (row.parity and row.grads_ok))
        )
    lines += [
        "",
        "| model type | model class | plan source | plan | lower | parity | max logit diff (tol) | gradients | share | SP"
        " | EP | reason |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in architectures_found:
        row = rows.get(name)
        if row is None:
            lines.append(f"| {name} |  |  | not run |  |  |  |  |  |  |  |  |")
            continue
        share = "" if row.param_share is None else f"{row.param_share:.2f}" + ("" if row.layers_sharded else " (emb)")
        diff = f"{row.logits_err:.1e} ({row.logits_tol:.1e})" if row.logits_err is not None else ""
        sp = sp_rows.get(name)
        sp_mark = _mark(sp.parity and sp.grads_ok) if sp is not None and sp.parity is not None else ""
        ep = ep_rows.get(name)
        ep_mark = _mark(ep.parity and ep.grads_ok) if ep is not None and ep.parity is not None else ""
        reason = _cell(row.reason) + (f" — {_cell(NOTES[name], None)}" if name in NOTES else "")
        if row.parity and row.grads_ok and not at_target(row):
            reason = _cell(_short_of_target(row) + (f" — {row.replicated}" if row.replicated else ""), 400)
            reason += f" — {_cell(NOTES[name], None)}" if name in NOTES else ""
        lines.append(
            f"| {name} | {row.model_class} | {row.plan_source} | {_mark(row.plan_ok)} | "
            f"{_mark(row.lower_ok) if row.plan_ok else ''} | "
            f"{_mark(row.parity)} | {diff} | {_mark(row.grads_ok)} | {share} | {sp_mark} | {ep_mark} | {reason} |"
        )
    lines += ["", "## Not at parity with the layers sharded, by cause", ""]
    missing = [r for r in ordered if not at_target(r)]
    for heading, members in (
        ("transformers itself cannot build or run the tiny config", [r for r in missing if transformers_fails(r)]),
        ("hpgen", [r for r in missing if not transformers_fails(r)]),
    ):
        groups: dict[str, list[str]] = {}
        for row in members:
            groups.setdefault(_cause(row), []).append(row.model_type)
        lines.append(f"{heading} ({len(members)}):")
        lines.append("")
        for cause, names in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
            lines.append(f"- **{cause}** ({len(names)}): {', '.join(names)}")
        lines.append("")
    sp_failures = {
        name: _cell(row.reason) + (f" — {_cell(SP_NOTES[name], None)}" if name in SP_NOTES else "")
        for name, row in sorted(sp_rows.items())
        if not (row.parity and row.grads_ok) and rows.get(name) and rows[name].parity
    }
    if sp_failures:
        lines += ["", "## Sequence parallel (`--sp`) failures where tensor parallel passes", ""]
        lines += [f"- **{name}**: {reason}" for name, reason in sp_failures.items()]
    return "\n".join(lines) + "\n"


def _minutes(rows: dict[str, Row]) -> str:
    """The wall time of the runs that wrote ``rows`` (their shares summed over resumed runs), or '' if unrecorded."""
    seconds = sum(row.wall for row in rows.values())
    return f"{seconds / 60:.0f} min" if seconds else ""


def at_target(row: Row) -> bool:
    """At parity (logits and every gradient) with the decoder layers sharded and each rank at most TARGET_SHARE."""
    return bool(
        row.parity and row.grads_ok and row.layers_sharded and row.param_share is not None
        and row.param_share <= TARGET_SHARE
    )


def _short_of_target(row: Row) -> str:
    """Why a row at parity does not count: nothing sharded in the layers, or a rank holds too much."""
    if not row.layers_sharded:
        return "at parity, but nothing inside the decoder layers is sharded"
    return f"at parity, but a rank holds {row.param_share:.2f} of the parameters (> {TARGET_SHARE})"


def transformers_fails(row: Row) -> bool:
    """transformers itself cannot build the tiny config's model or run it (not hpgen's failure)."""
    return (
        row.reason.startswith("config:")
        or "cannot build the model from its config" in row.reason
        or "transformers' own model" in row.reason
    )


def _has_expert_plan(model_type: str) -> bool:
    """The config (or its text config) has transformers' ``base_model_ep_plan``."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    return any(getattr(sub, "base_model_ep_plan", None) for sub in all_configs(config))


def _mark(value: bool | None) -> str:
    return "" if value is None else "yes" if value else "**no**"


def _cell(text: str, limit: int | None = 300) -> str:
    """One table cell: pipes escaped, one line, long messages cut at ``limit`` characters."""
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def _cause(row: Row) -> str:
    """A coarse failure class for grouping (the table keeps the full reason)."""
    reason = row.reason
    stage = reason.split(":", 1)[0]
    if row.parity and row.grads_ok:
        return _short_of_target(row).split(" of the parameters")[0].replace(f" {row.param_share:.2f}", " more")
    if row.model_type in COMPOSITE:
        return "the layers come from another modeling file or through AutoModel (hpgen lowers one file; see the notes)"
    if stage in ("config", "plan", "lower"):
        if "cannot build" in reason or stage == "config":
            return "config: transformers cannot build the tiny config or its model"
        return f"{stage}: " + reason.split(": ", 2)[-1][:100]
    if "transformers' own model" in reason:
        return "tiny config: transformers' own model fails on it"
    if reason.startswith("parity:"):
        return "parity: a rank raised (" + reason.split(":", 2)[1].strip()[:80] + ")"
    if "logits differ" in reason:
        return "parity: logits differ"
    if "gradients differ" in reason:
        return "gradients differ (logits equal)"
    return reason[:80]


def run(wanted: list[str], variant: str, path: Path, rows: dict[str, Row], chunk: int, timeout: float) -> None:
    """Plan, lower and compare ``wanted``, appending each row to ``path`` as it is known."""
    with tempfile.TemporaryDirectory(prefix="hpgen-coverage-") as folder:
        for start in range(0, len(wanted), chunk):
            began = time.monotonic()
            prepared = [prepare(name, Path(folder), variant=variant) for name in wanted[start : start + chunk]]
            cases = [case for _, case in prepared if case is not None]
            outcomes = compare(cases, timeout, variant) if cases else {}
            share = round((time.monotonic() - began) / len(prepared), 1)
            for row, case in prepared:
                if case is not None:
                    finish(row, outcomes[case.model_type])
                row.wall = share
                rows[row.model_type] = row
                with path.open("a") as stream:
                    stream.write(json.dumps(dataclasses.asdict(row), sort_keys=True) + "\n")
                status = (
                    "parity" if row.parity else "lowered" if row.lower_ok else "planned" if row.plan_ok else "failed"
                )
                print(f"{'' if variant == 'tp' else variant + ' '}{row.model_type}: {status} {row.reason[:200]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (their rows are redone)")
    parser.add_argument("--sp", action="store_true", help="run the --sp plans (the SP column) instead")
    parser.add_argument("--ep", action="store_true", help="run the --ep 2 plans of MoE models (the EP column) instead")
    parser.add_argument("--train", action="store_true", help="run the train-mode check (its own section) instead")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per architecture on the ranks")
    parser.add_argument("--chunk", type=int, default=8, help="architectures compared per spawn of the ranks")
    parser.add_argument("--results", type=Path, default=Path(tempfile.gettempdir()), help="folder of the results files")
    parser.add_argument("--table", type=Path, default=TABLE)
    parser.add_argument("--fresh", action="store_true", help="forget earlier results of this variant")
    parser.add_argument("--render", action="store_true", help="only rewrite the table from the results")
    args = parser.parse_args()

    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    found = architectures()
    variant = "sp" if args.sp else "ep" if args.ep else "train" if args.train else "tp"
    args.results.mkdir(parents=True, exist_ok=True)
    path = results_path(args.results, variant)
    if args.fresh and path.exists():
        path.unlink()
    variants = {name: load_results(results_path(args.results, name)) for name in VARIANTS}
    if not args.render:
        rows = variants[variant]
        wanted = args.only.split(",") if args.only else [name for name in found if name not in rows]
        if variant != "tp" and not args.only:  # only where the tensor-parallel plan already matches
            wanted = [name for name in wanted if variants["tp"].get(name) and variants["tp"][name].parity]
        if variant == "ep" and not args.only:
            wanted = [name for name in wanted if _has_expert_plan(name)]
        run(wanted, variant, path, rows, args.chunk, args.timeout)
        missing = [name for name in found if name not in variants["tp"]]
        if missing:  # a partial results folder (a fresh one with --only): the page would lose every other row
            print(
                f"results in {args.results} cover {len(found) - len(missing)} of {len(found)} model types (missing: "
                f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); {args.table} left as it is. Run "
                "without --only to fill them in, or give --results the folder of the full run.",
                file=sys.stderr,
            )
            return
    args.table.parent.mkdir(parents=True, exist_ok=True)
    section = render_train(variants["train"], found) if variants["train"] else ""
    if variant == "train":  # its own section: the rest of the page stays as the other variants' runs wrote it
        page = args.table.read_text() if args.table.exists() else ""
        args.table.write_text(_with_train_section(page, section))
    else:  # the sections other runs wrote (train mode without its results here, coverage_heads.py's) are kept
        old = args.table.read_text() if args.table.exists() else ""
        page = render(variants, found)
        for begin, end, text in ((TRAIN_BEGIN, TRAIN_END, section), (HEADS_BEGIN, HEADS_END, "")):
            text = text or section_of(old, begin, end)
            page = with_section(page, text, begin, end) if text else page
        args.table.write_text(page)
    print(f"wrote {args.table}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
