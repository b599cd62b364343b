"""Real checkpoints on 2 gloo ranks: from_pretrained, DCP, save_pretrained, load_state_dict.

The parent writes transformers checkpoints of tiny models with perturbed weights (one
file, or several with ``max_shard_size``) and lowers the modeling files; one spawn then
runs every case on both ranks and reports numbers that the tests check:

- ``hpgen.runtime.from_pretrained`` for Llama (vocab-parallel plan, untied and tied),
  Qwen3 (q/k norms) and Qwen3-MoE (experts ``SS(1,2)`` from per-expert checkpoint keys,
  and expert-parallel), with transformers' default attention and expert kernels: each
  rank's parameters equal its chunk of the checkpoint bit for bit, the logits equal
  those of transformers' unsharded ``from_pretrained`` of the same folder;
- DCP: ``dcp.save(model.state_dict())`` at tp=2, loaded into a fresh parallelized model
  (bit-exact), into the unsharded transformers model, and into another plan;
- ``model.save_pretrained(dir)`` at tp=2, loaded by transformers' own class; with
  transformers' keywords (``is_main_process=rank == 0``, ``max_shard_size``,
  ``safe_serialization``, ``state_dict=model.state_dict()``) over a folder whose other
  files survive; refusals on every rank (``state_dict`` on one rank only, a target that is
  a file); and killed (SIGKILL) at every step of its write (``checkpoint_kills.py``);
- ``load_state_dict(full unsharded state dict)`` after ``parallelize``, and one with a
  misshapen tensor (the message names the full shape and this rank's part);
- unreadable checkpoints named with their file on every rank (cut short, not safetensors,
  a shard missing or cut short), and a DCP checkpoint missing a ``.distcp`` file: with
  hpgen's checked reader the load fails before any tensor is touched;
- training: one AdamW step at tp=2, model and optimizer saved with DCP
  (``optimizer_state_dict``), resumed at tp=2 and in transformers' unsharded model with its
  own optimizer (tp=1); the next step matches the run that went on;
- DTensor's ``_StridedShard`` against ``SS(d,k)`` on real ranks.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.models import FAMILIES, TINY, expected_shard, import_file, load_plan_dict, lower_family, tolerance


@dataclass(frozen=True)
class Checkpoint:
    """A transformers checkpoint folder the parent wrote, and how to load it."""

    name: str
    family: str
    folder: str
    generated: str  # the modeling file lowered for ``plan``
    plan: str
    other_plan: str | None = None  # a second plan (its own generated file) for resharding
    other_generated: str | None = None


def _config(family: str, **overrides: Any) -> Any:
    """The tiny config, with transformers' default attention and expert kernels."""
    import transformers

    spec = FAMILIES[family]
    return getattr(transformers, spec.config)(**{**TINY, **spec.extra, **overrides})


def _write_checkpoint(
    family: str,
    folder: Path,
    seed: int,
    *,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    **config: Any,
) -> None:
    import transformers

    from tests.support.models import perturb_

    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family].model)(_config(family, **config))
    perturb_(model, seed)
    model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("checkpoints")
    files = {
        plan: str(lower_family(family, plan, root))
        for family, plan in [
            ("llama", "llama_tp_vocab"),
            ("llama", "llama_tp"),
            ("llama", "llama_tp_sp"),
            ("qwen3", "qwen3_tp"),
            ("qwen3_moe", "qwen3_moe_tp"),
            ("qwen3_moe", "qwen3_moe_tp_ep"),
        ]
    }
    _write_checkpoint("llama", root / "llama", 0)
    _write_checkpoint("llama", root / "llama_tied", 1, max_shard_size="100KB", tie_word_embeddings=True)
    _write_checkpoint("qwen3", root / "qwen3", 2)
    _write_checkpoint("qwen3_moe", root / "qwen3_moe", 3, max_shard_size="200KB")
    _write_checkpoint("llama", root / "llama_bf16", 0, dtype=torch.bfloat16)
    shutil.copytree(root / "llama", root / "llama_views")  # opened by hpgen only: its mappings are hpgen's
    # a checkpoint that lacks a weight
    shutil.copytree(root / "llama", root / "llama_broken")
    from safetensors.torch import load_file, save_file

    weights = load_file(root / "llama_broken" / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, root / "llama_broken" / "model.safetensors", metadata={"format": "pt"})
    # unreadable files: cut short, not safetensors at all, a shard gone, a shard cut short
    for name, damage in [("llama_truncated", "cut"), ("llama_text", "text")]:
        shutil.copytree(root / "llama", root / name)
        file = root / name / "model.safetensors"
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2] if damage == "cut" else b"version https://git-lfs.github.com/spec/v1\n")
    for name in ("llama_tied_shard_missing", "llama_tied_shard_truncated"):
        shutil.copytree(root / "llama_tied", root / name)
        shard = sorted((root / name).glob("model-*.safetensors"))[1]
        if name.endswith("missing"):
            shard.unlink()
        else:
            shard.write_bytes(shard.read_bytes()[:-100])

    cases = [
        Checkpoint(
            "llama",
            "llama",
            str(root / "llama"),
            files["llama_tp_vocab"],
            "llama_tp_vocab",
            "llama_tp",
            files["llama_tp"],
        ),
        Checkpoint("llama_tied", "llama", str(root / "llama_tied"), files["llama_tp_vocab"], "llama_tp_vocab"),
        Checkpoint("qwen3", "qwen3", str(root / "qwen3"), files["qwen3_tp"], "qwen3_tp"),
        Checkpoint("qwen3_moe", "qwen3_moe", str(root / "qwen3_moe"), files["qwen3_moe_tp"], "qwen3_moe_tp"),
        Checkpoint("qwen3_moe_ep", "qwen3_moe", str(root / "qwen3_moe"), files["qwen3_moe_tp_ep"], "qwen3_moe_tp_ep"),
    ]
    return run_distributed(_run_all, cases, str(root), files["llama_tp_sp"], timeout=400)


# --------------------------------------------------------------------------- on each rank


@dataclass
class Loaded:
    """What one rank saw for one checkpoint loaded with ``from_pretrained``."""

    logits_err: float
    logits_tol: float
    forward_error: str  # the forward raised (then logits_err is inf)
    weight_mismatches: list[str]  # params not bit-equal to this rank's chunk of the checkpoint
    weights_checked: int
    meta_left: list[str]
    training: bool
    devices: list[str]
    tied: bool
    inv_freq_equal: bool
    dtensor_keys: int  # state-dict entries that are DTensors with the global shape
    checkpoint_files: int
    views: int  # parameters whose bytes lie in a mapping of one of the checkpoint's files


@dataclass
class RankResults:
    loaded: dict[str, Loaded] = field(default_factory=dict)
    dcp: dict[str, list[str]] = field(default_factory=dict)  # check -> mismatching names
    logits: dict[str, tuple[float, float]] = field(default_factory=dict)  # check -> (err, tol)
    saved_keys: dict[str, list[str]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    strided: list[str] = field(default_factory=list)
    kills: dict[str, Any] = field(default_factory=dict)  # case -> what each kill of a save left (rank 0)
    loaded_views: dict[str, int] = field(default_factory=dict)  # views of the files, mappings, descriptors
    reduced: list[str] = field(default_factory=list)  # loaded parameters carrying a gradient reduction
    reduced_mismatches: list[str] = field(default_factory=list)  # ... whose gradient is not the unsharded one


def _inputs() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(11))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_inputs()).logits


def _compare(model: torch.nn.Module, reference: torch.nn.Module, plan: dict, rank: int, size: int) -> list[str]:
    """``model``'s parameters that are not bit-equal to the chunk of ``reference``'s the plan gives this rank."""
    from tests.support.models import param_layouts

    layouts = param_layouts(reference, plan)
    axis = plan["mesh_dim_names"][0]
    ours = dict(model.named_parameters(remove_duplicate=False))
    bad = []
    for name, ref_param in reference.named_parameters(remove_duplicate=False):
        want = expected_shard(ref_param.detach(), layouts.get(name, {}).get(axis, "R"), rank, size)
        if name not in ours or not torch.equal(ours[name].detach(), want):
            bad.append(name)
    return bad


def _file_mappings(folder: str) -> list[tuple[int, int]]:
    """The address ranges this process has mapped from files in ``folder`` (``/proc/self/maps``)."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(Path(folder).resolve()) + "/"):
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, stop))
    return found


def _in_mappings(tensor: torch.Tensor, folder: str) -> bool:
    """Whether ``tensor``'s bytes are a view of a file of ``folder`` (no copy was made)."""
    start = tensor.data_ptr()
    stop = start + tensor.numel() * tensor.element_size()
    return any(a <= start and stop <= b for a, b in _file_mappings(folder))


def _run_all(rank: int, world_size: int, cases: list[Checkpoint], root: str, files_sp: str) -> RankResults:
    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from hpgen.runtime import from_pretrained, parallelize
    from hpgen.runtime.checkpoint import checkpoint_files
    from hpgen.runtime.errors import ParallelizeError

    transformers.utils.logging.disable_progress_bar()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out = RankResults()
    models, references = {}, {}
    for case in cases:
        module = import_file(case.generated)
        cls = FAMILIES[case.family].model
        reference = getattr(transformers, cls).from_pretrained(case.folder).eval()
        plan = load_plan_dict(case.plan)
        # "llama" copies every slice (all are small); the others take contiguous ones as views of the file
        checkpoint_files.VIEW_MIN_BYTES = 2**30 if case.name == "llama" else 0
        model = from_pretrained(getattr(module, cls), case.folder, plan, mesh)
        try:
            err, tol, failure = (
                (_logits(model) - _logits(reference)).abs().max().item(),
                tolerance(_logits(reference)),
                "",
            )
        except Exception as error:  # noqa: BLE001 - reported by the logits test; the other checks still run
            err, tol, failure = float("inf"), 0.0, f"{type(error).__name__}: {error}"
        bad = _compare(model, reference, plan, rank, world_size)
        state = model.state_dict()
        full_shapes = dict(reference.state_dict())
        rotary = model.model.rotary_emb
        out.loaded[case.name] = Loaded(
            logits_err=err,
            logits_tol=tol,
            forward_error=failure,
            weight_mismatches=bad,
            weights_checked=len(list(reference.named_parameters(remove_duplicate=False))),
            meta_left=[n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta],
            training=model.training,
            devices=sorted({str(t.device) for t in [*model.parameters(), *model.buffers()]}),
            tied=model.lm_head.weight is model.model.embed_tokens.weight,
            inv_freq_equal=torch.equal(rotary.inv_freq, reference.model.rotary_emb.inv_freq),
            dtensor_keys=sum(
                isinstance(v, DTensor) and tuple(v.shape) == tuple(full_shapes[k].shape) for k, v in state.items()
            ),
            checkpoint_files=len(list(Path(case.folder).glob("*.safetensors"))),
            views=sum(_in_mappings(p, case.folder) for p in model.parameters()),
        )
        models[case.name], references[case.name] = model, reference

    # ---- a loaded model trains: under sequence parallelism the norms' gradients are summed over the
    # ranks by hooks parallelize attaches, which must sit on the Parameters read from the files
    reference = references["llama"]
    loaded = from_pretrained(getattr(import_file(files_sp), "LlamaForCausalLM"), cases[0].folder, load_plan_dict("llama_tp_sp"), mesh)
    loaded(_inputs()).logits.sum().backward()
    reference.zero_grad()
    reference(_inputs()).logits.sum().backward()
    expected = dict(reference.named_parameters())
    for name, param in loaded.named_parameters():
        if getattr(param, "_hp_grad_reduce", None) is not None:
            out.reduced.append(name)
            want = expected[name].grad
            if param.grad is None or (param.grad - want).abs().max() > 1e-5 * want.abs().max() + 1e-7:
                out.reduced_mismatches.append(name)
    reference.zero_grad()

    # ---- DCP: save at tp=2, load into a fresh parallelized model, the unsharded model, another plan
    for name in ("llama", "qwen3", "qwen3_moe"):
        case = next(c for c in cases if c.name == name)
        cls = FAMILIES[case.family].model
        model, reference = models[name], references[name]
        folder = f"{root}/dcp_{name}"
        dcp.save(model.state_dict(), checkpoint_id=folder)

        torch.manual_seed(100 + rank)  # a fresh model whose weights differ on every rank
        fresh = getattr(import_file(case.generated), cls)(reference.config)
        parallelize(fresh, load_plan_dict(case.plan), mesh)
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=folder)
        fresh.load_state_dict(state)
        out.dcp[f"{name}: round trip"] = [
            n for (n, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()) if not torch.equal(p, q)
        ]

        plain = getattr(transformers, cls)(reference.config)
        state = plain.state_dict()
        dcp.load(state, checkpoint_id=folder)
        plain.load_state_dict(state)
        expected = reference.state_dict()
        out.dcp[f"{name}: to unsharded"] = [n for n, t in plain.state_dict().items() if not torch.equal(t, expected[n])]

        if case.other_plan:
            other_plan = load_plan_dict(case.other_plan)
            other = getattr(import_file(case.other_generated), cls)(reference.config).eval()
            parallelize(other, other_plan, mesh)
            state = other.state_dict()
            dcp.load(state, checkpoint_id=folder)
            other.load_state_dict(state)
            out.dcp[f"{name}: to {case.other_plan}"] = _compare(other, reference, other_plan, rank, world_size)
            out.logits[f"{name}: dcp to {case.other_plan}"] = (
                (_logits(other) - _logits(reference)).abs().max().item(),
                tolerance(_logits(reference)),
            )

    # ---- save_pretrained at tp=2 -> transformers' own class
    for name in ("llama", "llama_tied", "qwen3_moe"):
        case = next(c for c in cases if c.name == name)
        cls = FAMILIES[case.family].model
        folder = f"{root}/saved_{name}"
        models[name].save_pretrained(folder)
        loaded = getattr(transformers, cls).from_pretrained(folder).eval()
        expected = references[name].state_dict()
        out.dcp[f"{name}: save_pretrained"] = [
            n for n, t in loaded.state_dict().items() if not torch.equal(t, expected[n])
        ]
        out.logits[f"{name}: save_pretrained"] = (
            (_logits(loaded) - _logits(references[name])).abs().max().item(),
            tolerance(_logits(references[name])),
        )
        from safetensors import safe_open

        keys = []
        for file in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(file, "pt") as handle:
                keys += list(handle.keys())
        out.saved_keys[name] = sorted(keys)
        out.saved_keys[f"{name} (transformers)"] = sorted(
            key for file in Path(case.folder).glob("*.safetensors") for key in safe_open(file, "pt").keys()
        )

    # ---- transformers' keywords, over a folder that holds other files
    folder = Path(f"{root}/saved_keywords")
    if rank == 0:
        folder.mkdir()
        (folder / "tokenizer.json").write_text("{}")
        Path(f"{root}/saved_given_real").mkdir()  # saved_given is a link to it: the save keeps the link
        Path(f"{root}/saved_given").symlink_to("saved_given_real", target_is_directory=True)
    torch.distributed.barrier()
    models["llama"].save_pretrained(folder, is_main_process=rank == 0, max_shard_size="100KB", safe_serialization=True)
    loaded = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    out.logits["llama: save_pretrained(is_main_process, max_shard_size)"] = (
        (_logits(loaded) - _logits(references["llama"])).abs().max().item(),
        tolerance(_logits(references["llama"])),
    )
    out.saved_keys["keywords: files"] = sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(".saved"))
    out.saved_keys["keywords: folder"] = sorted(p.name for p in folder.iterdir())
    models["llama"].save_pretrained(folder, is_main_process=False)  # nobody writes; every rank still gathers
    out.saved_keys["keywords: not main"] = sorted(p.name for p in folder.iterdir())
    models["llama"].save_pretrained(f"{root}/saved_given", state_dict=models["llama"].state_dict())  # DTensors
    loaded = transformers.LlamaForCausalLM.from_pretrained(f"{root}/saved_given").eval()
    link = Path(f"{root}/saved_given")
    out.saved_keys["given: link"] = [os.readlink(link) if link.is_symlink() else "not a link"]
    out.saved_keys["given: real folder"] = sorted(p.name for p in Path(f"{root}/saved_given_real").iterdir())
    out.logits["llama: save_pretrained(state_dict=model.state_dict())"] = (
        (_logits(loaded) - _logits(references["llama"])).abs().max().item(),
        tolerance(_logits(references["llama"])),
    )
    if rank == 0:
        Path(f"{root}/a_file").write_text("not a folder")
    torch.distributed.barrier()
    for label, call in [
        ("state_dict on rank 0 only", lambda: models["llama"].save_pretrained(
            f"{root}/saved_refused", state_dict=references["llama"].state_dict() if rank == 0 else None)),
        ("writer fails", lambda: models["llama"].save_pretrained(f"{root}/a_file")),
    ]:
        try:
            call()
            out.errors[label] = "no error"
        except ParallelizeError as error:
            out.errors[label] = str(error)

    # ---- save_pretrained killed at every step of its write
    from tests.support.checkpoint_kills import kill_saves

    out.kills = kill_saves(models["llama"], transformers.LlamaForCausalLM, root, rank, _inputs())

    # ---- load_state_dict(full unsharded) after parallelize
    case = cases[0]
    reference = references["llama"]
    model = import_file(case.generated).LlamaForCausalLM(reference.config).eval()
    parallelize(model, load_plan_dict(case.plan), mesh)
    model.load_state_dict(reference.state_dict())
    out.dcp["llama: load_state_dict(full)"] = _compare(model, reference, load_plan_dict(case.plan), rank, world_size)
    out.logits["llama: load_state_dict(full)"] = (
        (_logits(model) - _logits(reference)).abs().max().item(),
        tolerance(_logits(reference)),
    )

    # ---- refusals
    module = import_file(case.generated)
    unreadable = [
        ("missing weight", f"{root}/llama_broken"),
        ("not a checkpoint", root),  # a folder of checkpoint folders
        ("no folder", f"{root}/nowhere"),
        ("truncated file", f"{root}/llama_truncated"),
        ("not safetensors", f"{root}/llama_text"),
        ("shard missing", f"{root}/llama_tied_shard_missing"),
        ("truncated shard", f"{root}/llama_tied_shard_truncated"),
    ]
    for label, folder in unreadable:
        try:
            from_pretrained(module.LlamaForCausalLM, folder, load_plan_dict(case.plan), mesh, config=reference.config)
            out.errors[label] = "no error"
        except ParallelizeError as error:
            out.errors[label] = str(error)
    try:  # no config= either: the folder is named before its config.json is looked for
        from_pretrained(module.LlamaForCausalLM, f"{root}/nowhere/", load_plan_dict(case.plan), mesh)
        out.errors["no folder, no config"] = "no error"
    except ParallelizeError as error:
        out.errors["no folder, no config"] = str(error)

    _dtypes_and_mappings(out, case, root, mesh, rank, world_size)
    _misshapen_state_dict(out, case, reference, mesh)
    _failed_dcp_loads(out, case, models["llama"], root, mesh)
    out.strided = _strided_shard_checks(mesh, rank, world_size)
    _train_save_resume(out, cases[0], references["llama"], models["llama"], root, mesh, rank, world_size)
    return out


def _dtypes_and_mappings(out: RankResults, case: Checkpoint, root: str, mesh: Any, rank: int, size: int) -> None:
    """Loads that cast (bf16 file -> float32, float32 file -> bf16), bit-equal to transformers' cast of the
    same file; then what a load leaves of the files: views' mappings, no descriptor, nothing once freed."""
    import gc
    import os

    import transformers

    from hpgen.runtime import from_pretrained
    from hpgen.runtime.checkpoint import checkpoint_files

    cls = import_file(case.generated).LlamaForCausalLM
    plan = load_plan_dict(case.plan)
    checkpoint_files.VIEW_MIN_BYTES = 0  # every contiguous shard a view where the dtype allows it
    for label, folder, dtype in [
        ("bf16 file as float32", f"{root}/llama_bf16", torch.float32),
        ("float32 file as bf16", f"{root}/llama", torch.bfloat16),
        ("bf16 file, auto", f"{root}/llama_bf16", "auto"),
    ]:
        model = from_pretrained(cls, folder, plan, mesh, dtype=dtype)
        want = torch.bfloat16 if dtype == "auto" else dtype
        reference = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=want).eval()
        out.dcp[f"{label}: mismatches"] = _compare(model, reference, plan, rank, size)
        out.errors[f"{label}: dtypes"] = str(sorted({str(p.dtype) for p in model.parameters()}))
        out.loaded_views[label] = sum(_in_mappings(p, folder) for p in model.parameters())
        if want == torch.float32:  # bf16 logits of a tp=2 run are not within float32's tolerance
            out.logits[label] = ((_logits(model) - _logits(reference)).abs().max().item(), tolerance(_logits(reference)))
        del model, reference

    folder = f"{root}/llama_views"
    model = from_pretrained(cls, folder, plan, mesh)
    descriptors = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
    out.loaded_views["views: mappings while loaded"] = len(_file_mappings(folder))
    out.loaded_views["views: descriptors while loaded"] = sum(d.startswith(str(Path(folder).resolve())) for d in descriptors)
    reference = _logits(transformers.LlamaForCausalLM.from_pretrained(case.folder))
    out.logits["views"] = ((_logits(model) - reference).abs().max().item(), tolerance(reference))
    del model
    gc.collect()
    out.loaded_views["views: mappings once freed"] = len(_file_mappings(folder))


def _misshapen_state_dict(out: RankResults, case: Checkpoint, reference: Any, mesh: Any) -> None:
    """``load_state_dict`` of a full state dict with one parameter of the wrong full shape."""
    from hpgen.runtime import parallelize

    model = import_file(case.generated).LlamaForCausalLM(reference.config)
    parallelize(model, load_plan_dict(case.plan), mesh)
    state = dict(reference.state_dict())
    state["model.embed_tokens.weight"] = torch.zeros(TINY["vocab_size"] + 1, TINY["hidden_size"])
    try:
        model.load_state_dict(state)
        out.errors["misshapen state dict"] = "no error"
    except RuntimeError as error:
        out.errors["misshapen state dict"] = str(error)


def _failed_dcp_loads(out: RankResults, case: Checkpoint, model: Any, root: str, mesh: Any) -> None:
    """A DCP checkpoint with one ``.distcp`` file gone: with hpgen's checked reader nothing is touched."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hpgen.runtime import checked_reader

    folder = Path(f"{root}/dcp_missing_file")
    with torch.no_grad():
        source = {key: value * 2 if value.is_floating_point() else value for key, value in model.state_dict().items()}
    dcp.save(source, checkpoint_id=folder)
    dist.barrier()
    if dist.get_rank() == 0:
        sorted(folder.glob("*.distcp"))[-1].unlink()
    dist.barrier()
    for label, reader in [("checked", checked_reader(folder)), ("plain", None)]:
        before = {name: param.detach().clone() for name, param in model.named_parameters()}
        state = model.state_dict()
        try:
            dcp.load(state, checkpoint_id=None if reader else folder, storage_reader=reader)
            out.errors[f"dcp load, {label}"] = "no error"
        except (Exception, CheckpointException) as error:  # noqa: BLE001 - DCP's is a BaseException
            out.errors[f"dcp load, {label}"] = str(error)
        changed = [name for name, param in model.named_parameters() if not torch.equal(param, before[name])]
        out.dcp[f"dcp load, {label}: changed"] = changed
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(before[name])


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One AdamW step on a fixed loss (the logits against a seeded projection)."""
    logits = model(_inputs()).logits
    projection = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
    (logits * projection).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _train_save_resume(
    out: RankResults, case: Checkpoint, reference: Any, model: Any, root: str, mesh: Any, rank: int, size: int
) -> None:
    """Train a step at tp=2, save model and optimizer with DCP, resume at tp=2 (fresh) and at tp=1, step again."""
    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from hpgen.runtime import load_optimizer_state_dict, optimizer_state_dict, parallelize

    plan = load_plan_dict(case.plan)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer, 1)
    folder = f"{root}/dcp_train"
    dcp.save({"model": model.state_dict(), "optim": optimizer_state_dict(model, optimizer)}, checkpoint_id=folder)

    # resume at tp=2 in a fresh parallelized model
    fresh = import_file(case.generated).LlamaForCausalLM(reference.config).train()
    parallelize(fresh, plan, mesh)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = {"model": fresh.state_dict(), "optim": optimizer_state_dict(fresh, fresh_optimizer)}
    dcp.load(state, checkpoint_id=folder)
    fresh.load_state_dict(state["model"])
    load_optimizer_state_dict(fresh, fresh_optimizer, state["optim"])

    # resume at tp=1: transformers' own model and optimizer, no hpgen
    plain = transformers.LlamaForCausalLM(reference.config).train()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    state = {"model": plain.state_dict(), "optim": get_optimizer_state_dict(plain, plain_optimizer)}
    dcp.load(state, checkpoint_id=folder)
    plain.load_state_dict(state["model"])
    set_optimizer_state_dict(plain, plain_optimizer, state["optim"])

    layouts = _layouts(reference, plan)
    ours = dict(model.named_parameters())
    mismatched = []
    for name, param in plain.named_parameters():
        for label, value in [("exp_avg", plain_optimizer.state[param]["exp_avg"]), ("param", param.detach())]:
            mine = (
                fresh_optimizer.state[dict(fresh.named_parameters())[name]]["exp_avg"] if label == "exp_avg" else None
            )
            want = expected_shard(value, layouts.get(name, "R"), rank, size)
            original = optimizer.state[ours[name]]["exp_avg"] if label == "exp_avg" else ours[name].detach()
            if not torch.equal(original, want):
                mismatched.append(f"tp=1 {label} {name}")
            if mine is not None and not torch.equal(mine, original):
                mismatched.append(f"tp=2 {label} {name}")
    out.dcp["train: resumed state"] = mismatched

    # one more step everywhere: the resumed runs continue the original one
    for run, run_optimizer in [(model, optimizer), (fresh, fresh_optimizer), (plain, plain_optimizer)]:
        _step(run, run_optimizer, 2)
    worst = {"tp=2": 0.0, "tp=1": 0.0}
    fresh_params = dict(fresh.named_parameters())
    for name, param in plain.named_parameters():
        want = ours[name].detach()
        worst["tp=2"] = max(worst["tp=2"], (fresh_params[name].detach() - want).abs().max().item())
        shard = expected_shard(param.detach(), layouts.get(name, "R"), rank, size)
        worst["tp=1"] = max(worst["tp=1"], (shard - want).abs().max().item())
    out.logits["train: tp=2 resumed, next step"] = (worst["tp=2"], 0.0)
    out.logits["train: tp=1 resumed, next step"] = (worst["tp=1"], 1e-5)


def _layouts(reference: Any, plan: dict) -> dict[str, str]:
    from tests.support.models import param_layouts

    axis = plan["mesh_dim_names"][0]
    return {name: layout.get(axis, "R") for name, layout in param_layouts(reference, plan).items()}


def _strided_shard_checks(mesh: Any, rank: int, size: int) -> list[str]:
    """DTensor's ``_StridedShard(d, sf=k)`` holds exactly hpgen's ``SS(d,k)`` chunk, both ways."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from hpgen.core.placement import Placement
    from hpgen.core.shards import ShardLayout

    failures = []
    for shape, dim, k in [((12, 3), 0, 2), ((18, 2), 0, 3), ((3, 14), 1, 2), ((2, 10, 4), 1, 2)]:
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
        ours = ShardLayout(shape, [(Placement("SS", dim=dim, blocks=k), rank, size)]).local_slice(full)
        placement = _StridedShard(dim, split_factor=k)
        # src_data_rank=None: each rank splits locally (DTensor's scatter path needs even blocks)
        theirs = distribute_tensor(full, mesh, [placement], src_data_rank=None).to_local()
        back = DTensor.from_local(ours, mesh, [placement], run_check=False, shape=full.shape, stride=full.stride())
        if not torch.equal(ours, theirs):
            failures.append(f"{shape} SS({dim},{k}): distribute_tensor gives another chunk")
        if not torch.equal(back.full_tensor(), full):
            failures.append(f"{shape} SS({dim},{k}): full_tensor of hpgen's chunk is not the tensor")
    return failures


# --------------------------------------------------------------------------- checks

LOADED = ["llama", "llama_tied", "qwen3", "qwen3_moe", "qwen3_moe_ep"]


@pytest.mark.parametrize("name", LOADED)
def test_from_pretrained_reads_each_ranks_chunk(results: list[RankResults], name: str) -> None:
    for rank, result in enumerate(results):
        loaded = result.loaded[name]
        assert loaded.weights_checked > 0
        assert not loaded.weight_mismatches, f"rank {rank}: {loaded.weight_mismatches}"
        assert not loaded.meta_left and loaded.devices == ["cpu"] and not loaded.training
        assert loaded.inv_freq_equal, f"rank {rank}: rotary inv_freq not initialised like transformers'"


@pytest.mark.parametrize("name", LOADED)
def test_from_pretrained_logits(results: list[RankResults], name: str) -> None:
    for rank, result in enumerate(results):
        loaded = result.loaded[name]
        assert not loaded.forward_error, f"rank {rank}: the forward raised {loaded.forward_error}"
        assert loaded.logits_err <= loaded.logits_tol, f"rank {rank}: {loaded.logits_err} > {loaded.logits_tol}"


def test_multi_file_checkpoints_and_ties(results: list[RankResults]) -> None:
    loaded = results[0].loaded
    assert loaded["llama"].views == 0 and all(loaded[name].views > 0 for name in LOADED[1:])
    assert loaded["llama"].checkpoint_files == 1 and loaded["llama_tied"].checkpoint_files > 1
    assert loaded["qwen3_moe"].checkpoint_files > 1
    assert all(r.loaded["llama_tied"].tied for r in results)
    assert not any(r.loaded["llama"].tied for r in results)


def test_state_dict_gives_dtensors_with_global_shapes(results: list[RankResults]) -> None:
    # every sharded parameter is a DTensor of its full shape: embedding and lm_head, then per layer
    # q, k, v, o and gate, up, down (Llama) or the experts' gate_up_proj (SS) and down_proj (Qwen3-MoE)
    loaded = results[0].loaded
    assert loaded["llama"].dtensor_keys == 2 + 7 * TINY["num_hidden_layers"]
    assert loaded["qwen3_moe"].dtensor_keys == 2 + 6 * TINY["num_hidden_layers"]


@pytest.mark.parametrize(
    "check",
    [
        "llama: round trip",
        "qwen3: round trip",
        "qwen3_moe: round trip",
        "llama: to unsharded",
        "qwen3: to unsharded",
        "qwen3_moe: to unsharded",
        "llama: to llama_tp",
        "llama: save_pretrained",
        "llama_tied: save_pretrained",
        "qwen3_moe: save_pretrained",
        "llama: load_state_dict(full)",
        "train: resumed state",
    ],
)
def test_bit_exact(results: list[RankResults], check: str) -> None:
    for rank, result in enumerate(results):
        assert result.dcp[check] == [], f"rank {rank}: {check}: {result.dcp[check]}"


@pytest.mark.parametrize(
    "check",
    [
        "llama: dcp to llama_tp",
        "llama: save_pretrained",
        "llama_tied: save_pretrained",
        "qwen3_moe: save_pretrained",
        "llama: load_state_dict(full)",
    ],
)
def test_logits_after(results: list[RankResults], check: str) -> None:
    for rank, result in enumerate(results):
        err, tol = result.logits[check]
        assert err <= tol, f"rank {rank}: {check}: {err} > {tol}"


def test_save_pretrained_writes_transformers_layout(results: list[RankResults]) -> None:
    saved = results[0].saved_keys
    for name in ("llama", "llama_tied", "qwen3_moe"):
        assert saved[name] == saved[f"{name} (transformers)"]  # per-expert MoE keys, tied lm_head dropped
    assert any(".experts.0.gate_proj.weight" in key for key in saved["qwen3_moe"])
    assert "lm_head.weight" not in saved["llama_tied"]


def test_save_pretrained_takes_transformers_keywords(results: list[RankResults]) -> None:
    for rank, result in enumerate(results):
        err, tol = result.logits["llama: save_pretrained(is_main_process, max_shard_size)"]
        assert err <= tol, f"rank {rank}: {err} > {tol}"
    saved = results[0].saved_keys
    assert saved["keywords: files"] == []  # no temporary folder beside it
    assert "tokenizer.json" in saved["keywords: folder"] and "model.safetensors.index.json" in saved["keywords: folder"]
    assert not any(name.startswith(".") for name in saved["keywords: folder"])
    assert saved["keywords: not main"] == saved["keywords: folder"]
    assert saved["given: link"] == ["saved_given_real"]  # a symlinked folder keeps its link
    assert "config.json" in saved["given: real folder"] and "model.safetensors" in saved["given: real folder"]
    for rank, result in enumerate(results):
        err, tol = result.logits["llama: save_pretrained(state_dict=model.state_dict())"]
        assert err <= tol, f"rank {rank}: {err} > {tol}"
        assert "ranks [0] passed state_dict= and the others did not" in result.errors["state_dict on rank 0 only"]
        assert "a_file is a file, not a folder" in result.errors["writer fails"], result.errors["writer fails"]
    assert results[1].errors["writer fails"].startswith("rank 0 could not write the checkpoint, so this rank stops")


def test_a_killed_save_pretrained_leaves_the_old_or_the_new_checkpoint(results: list[RankResults]) -> None:
    """SIGKILL at every file-system step of the write (one file, shards, the two-rename fallback)."""
    kills = results[0].kills
    assert set(kills) == {"one file", "sharded", "sharded, two renames"}
    for label, found in kills.items():
        assert found["kills"] == found["steps"] >= 10, (label, found["steps"])
        outcomes = found["outcomes"]
        assert outcomes[0] == "new", (label, outcomes[0])  # the save that was not killed
        assert set(outcomes) <= {"old", "new"}, (label, [o for o in outcomes if o not in ("old", "new")])
        assert {"old", "new"} <= set(outcomes[1:]), label  # kills before and after the swap
        assert found["leftovers"] == [], (label, found["leftovers"][:3])
        assert all(found["kept"]), label  # the folder's other files survive
    assert sum(found["kills"] for found in kills.values()) >= 40


def test_a_loaded_model_sums_the_gradients_of_its_sequence_parallel_norms(results: list[RankResults]) -> None:
    """``from_pretrained`` attaches ``parallelize``'s hooks to the Parameters it read: under a
    sequence-parallel plan each norm's gradient, summed over the ranks' sequence shards, is the
    unsharded model's."""
    norms = {f"model.layers.{i}.{norm}.weight" for i in (0, 1) for norm in ("input_layernorm", "post_attention_layernorm")}
    for rank in results:
        assert set(rank.reduced) == norms | {"model.norm.weight"}
        assert rank.reduced_mismatches == []


def test_refusals_are_clear(results: list[RankResults]) -> None:
    for errors in (result.errors for result in results):  # on every rank
        assert "has no weights for 1 parameter(s)" in errors["missing weight"]
        assert "model.layers.1.mlp.down_proj.weight" in errors["missing weight"]
        assert "not a safetensors checkpoint folder" in errors["not a checkpoint"]
        assert errors["no folder"].endswith("/nowhere: no such folder"), errors["no folder"]
        assert errors["no folder, no config"] == errors["no folder"]
        assert "llama_truncated/model.safetensors is truncated: its tensors need" in errors["truncated file"]
        assert "llama_text/model.safetensors is not a safetensors file" in errors["not safetensors"]
        assert "model.safetensors.index.json names shard files that are not in" in errors["shard missing"]
        assert "llama_tied_shard_missing" in errors["shard missing"] and "-of-" in errors["shard missing"]
        assert "llama_tied_shard_truncated/model-00002-of-" in errors["truncated shard"]
        assert "is truncated" in errors["truncated shard"]


@pytest.mark.parametrize(
    "label, dtype, views",
    [
        ("bf16 file as float32", "torch.float32", False),
        ("float32 file as bf16", "torch.bfloat16", False),
        ("bf16 file, auto", "torch.bfloat16", True),
    ],
)
def test_from_pretrained_casts_exactly(results: list[RankResults], label: str, dtype: str, views: bool) -> None:
    """Each rank's shard, read straight into the target dtype, is transformers' cast of the file, bit for bit;
    only a load in the file's own dtype keeps views of it."""
    for rank, result in enumerate(results):
        assert result.dcp[f"{label}: mismatches"] == [], f"rank {rank}: {result.dcp[f'{label}: mismatches']}"
        assert result.errors[f"{label}: dtypes"] == f"['{dtype}']"
        assert (result.loaded_views[label] > 0) == views, (rank, result.loaded_views[label])
        if dtype == "torch.float32":
            err, tol = result.logits[label]
            assert err <= tol, f"rank {rank}: {err} > {tol}"


def test_a_load_leaves_views_of_the_files_and_no_descriptor_and_nothing_once_freed(results: list[RankResults]) -> None:
    for rank, result in enumerate(results):
        views = result.loaded_views
        assert views["views: mappings while loaded"] > 0, rank
        assert views["views: descriptors while loaded"] == 0, rank
        assert views["views: mappings once freed"] == 0, rank
        err, tol = result.logits["views"]
        assert err <= tol, f"rank {rank}: {err} > {tol}"


def test_misshapen_state_dict_names_the_full_and_the_local_shape(results: list[RankResults]) -> None:
    for rank, result in enumerate(results):
        message = result.errors["misshapen state dict"]
        local = (TINY["vocab_size"] + 1 - rank) // 2  # tensor_split of 127 rows: 64, 63
        assert "size mismatch for model.embed_tokens.weight: copying a param with shape (128, 64)" in message
        assert f"full shape is (127, 64) (this rank holds ({local}, 64) of it: tp S(0) over 2)" in message
        assert "Missing key" not in message and "shape in current model" not in message


def test_a_failed_dcp_load_with_the_checked_reader_touches_nothing(results: list[RankResults]) -> None:
    for rank, result in enumerate(results):
        message = result.errors["dcp load, checked"]
        assert "cannot be loaded, nothing was read" in message and ".distcp is missing" in message, message
        assert result.dcp["dcp load, checked: changed"] == [], f"rank {rank}"
        assert result.errors["dcp load, plain"] != "no error"
    # torch's own reader fails part way: what it read before the missing file is in the model
    assert any(result.dcp["dcp load, plain: changed"] for result in results)


def test_dtensor_strided_shard_is_hpgen_ss(results: list[RankResults]) -> None:
    for rank, result in enumerate(results):
        assert result.strided == [], f"rank {rank}: {result.strided}"


# --------------------------------------------------------------------------- tp=4: RS and uneven shards


@pytest.fixture(scope="module")
def results4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Llama at tp=4 on 4 ranks with ``hpgen plan``'s plan: 2 key/value heads replicated
    (``RS(0,2)``), and sizes that split unevenly (vocab 127, intermediate 89): the state
    dict's DTensors are copies laid out DTensor's way there."""
    import json

    from hpgen.planner.model.load import load_config, meta_model
    from hpgen.planner.translate.translator import translated_plan

    root = tmp_path_factory.mktemp("checkpoints4")
    _write_checkpoint("llama", root / "llama", 5, max_shard_size="100KB")
    config_path = str(root / "llama" / "config.json")
    plan = translated_plan(meta_model(load_config(config_path)), tp=4, name=config_path)
    (root / "plan.json").write_text(json.dumps(plan))
    generated = str(lower_family("llama", plan, root))
    return run_distributed(_run_tp4, str(root), generated, plan, world_size=4, timeout=400)


def _shard(full: torch.Tensor, placement: str, rank: int, size: int) -> torch.Tensor:
    """``expected_shard`` and ``RS(d,r)``: chunk ``rank // r`` of ``size / r``."""
    if placement.startswith("RS("):
        dim, replicas = (int(part) for part in placement[3:-1].split(","))
        return full.tensor_split(size // replicas, dim)[rank // replicas]
    return expected_shard(full, placement, rank, size)


def _run_tp4(rank: int, world_size: int, root: str, generated: str, plan: dict) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from hpgen.runtime import from_pretrained, parallelize

    transformers.utils.logging.disable_progress_bar()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    folder = f"{root}/llama"
    reference = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    expected = reference.state_dict()
    layouts = _layouts(reference, plan)
    cls = import_file(generated).LlamaForCausalLM
    model = from_pretrained(cls, folder, plan, mesh)
    out: dict[str, Any] = {}

    def mismatches(candidate: torch.nn.Module) -> list[str]:
        ours = dict(candidate.named_parameters())
        return [
            n
            for n, full in expected.items()
            if not torch.equal(ours[n].detach(), _shard(full, layouts.get(n, "R"), rank, world_size))
        ]

    out["from_pretrained"] = mismatches(model)
    out["logits"] = ((_logits(model) - _logits(reference)).abs().max().item(), tolerance(_logits(reference)))
    state = model.state_dict()
    out["placements"] = {
        k: str(tuple(v.placements)) for k, v in state.items() if isinstance(v, DTensor) and "layers.0." in k
    }
    out["global shapes"] = [
        k for k, v in state.items() if isinstance(v, DTensor) and tuple(v.shape) != tuple(expected[k].shape)
    ]
    dcp.save(state, checkpoint_id=f"{root}/dcp")

    fresh = cls(reference.config).eval()
    parallelize(fresh, plan, mesh)
    fresh_state = fresh.state_dict()
    dcp.load(fresh_state, checkpoint_id=f"{root}/dcp")
    fresh.load_state_dict(fresh_state)
    out["dcp round trip"] = mismatches(fresh)

    plain = transformers.LlamaForCausalLM(reference.config)
    plain_state = plain.state_dict()
    dcp.load(plain_state, checkpoint_id=f"{root}/dcp")
    plain.load_state_dict(plain_state)
    out["dcp to unsharded"] = [n for n, t in plain.state_dict().items() if not torch.equal(t, expected[n])]

    model.save_pretrained(f"{root}/saved")
    saved = transformers.LlamaForCausalLM.from_pretrained(f"{root}/saved")
    out["save_pretrained"] = [n for n, t in saved.state_dict().items() if not torch.equal(t, expected[n])]
    return out


def test_tp4_replicated_kv_heads_and_uneven_shards(results4: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results4):
        for check in ("from_pretrained", "dcp round trip", "dcp to unsharded", "save_pretrained", "global shapes"):
            assert result[check] == [], f"rank {rank}: {check}: {result[check]}"
        err, tol = result["logits"]
        assert err <= tol, f"rank {rank}: logits {err} > {tol}"
    placements = results4[0]["placements"]
    assert placements["model.layers.0.self_attn.k_proj.weight"] == "(Shard(dim=0), Replicate())"  # RS(0,2)
    assert placements["model.layers.0.self_attn.q_proj.weight"] == "(Shard(dim=0),)"
