"""Training runs of transformers' ``Trainer`` on a tiny Llama, for ``test_trainer.py``: rank bodies and the reference.

Every run trains the same perturbed tiny Llama (``tests.support.models``' shape, vocab 127,
hidden 64, 2 layers) on the same 16 sequences, 4 AdamW steps of 4 sequences, with
``max_grad_norm`` below the gradient norm (clipping active), ``logging_steps=1``. The
reference is the unsharded model in a stock ``transformers.Trainer`` on one process; the
cases are the parallelized model in ``hpgen.runtime.trainer.Trainer`` on 2 or 4 gloo ranks.
Each run returns its per-step losses and logged ``grad_norm``s and the final weights (the
unsharded state dict, gathered), and the parent compares them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

STEPS, BATCH, SEQ, SAMPLES = 4, 4, 12, 16
MAX_GRAD_NORM = 0.5  # the tiny model's gradient norm is about 2-3: every step clips
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Run:
    """One Trainer run: the plan (``tp``, ``sp``, the config's KV heads), the mesh, LoRA, saving and resuming."""

    name: str
    tp: int = 2
    dp: int = 1
    pp: int = 1  # pipeline stages (outermost on the mesh); tp 1 with pp: transformers' own class, nothing lowered
    microbatches: int | None = None  # the Trainer's pipeline_microbatches (None: its default)
    schedule: str = "1F1B"
    accumulate: int = 1  # gradient_accumulation_steps (the reference accumulates alike)
    ignored: bool = False  # labels -100 over an unequal part of each sequence (a mean per batch would differ)
    sp: bool = False
    kv_heads: int = 2
    fsdp: bool = False
    lora: str = ""  # "after": get_peft_model after parallelize; "before": parallelize the peft model
    save: bool = False  # a checkpoint at step 2 (and 4)
    resume: str = ""  # the name of a saved run: a fresh model resumes its checkpoint-2
    # "hpgen": hpgen.runtime.trainer.Trainer; "hpgen, another mesh": hpgen's Trainer resuming ``resume``'s
    # checkpoint, written on another mesh; "hpgen, no torchrun environment": hpgen's Trainer where accelerate cannot
    # see the distributed run (the stock loops: tests.support.stock_loops)
    loop: str = "hpgen"
    defaults: bool = False  # TrainingArguments(output_dir) as constructed, nothing else: 3 epochs, logged at the end
    evaluate: bool = False  # trainer.evaluate() on an eval set of 10 (a remainder: 10 = 8 + 2) before and after
    # evaluate() and predict() gathering as objects (eval_use_gather_object) predictions that are not one tensor
    # (each row's argmax tokens, rows of unequal lengths, batches kept apart) with a metric of them
    gather_object: bool = False
    check_inputs: bool = True  # parallelize's input check
    generated: str = ""  # the generated file (lowered by the parent)
    plan: dict = field(default_factory=dict)


class _Recorder:
    """A TrainerCallback keeping each step's logged loss and grad_norm."""

    def __new__(cls) -> Any:
        from transformers import TrainerCallback

        class Recorder(TrainerCallback):
            def __init__(self) -> None:
                self.steps: dict[int, tuple[float, float]] = {}

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
                if logs and "loss" in logs and "grad_norm" in logs:
                    self.steps[state.global_step] = (float(logs["loss"]), float(logs["grad_norm"]))

        return Recorder()


def dataset(ignored: bool = False) -> list[dict[str, torch.Tensor]]:
    """The training sequences; with ``ignored``, sample ``i``'s first ``i % 7`` labels are -100 (batches and their
    halves count unequal label tokens)."""
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 127, (SAMPLES, SEQ), generator=generator)
    rows = [{"input_ids": row, "labels": row.clone()} for row in ids]
    if ignored:
        for index, row in enumerate(rows):
            row["labels"][: index % 7] = -100
    return rows


def config(kv_heads: int = 2) -> Any:
    from tests.support.models import make_config

    return make_config("llama", num_key_value_heads=kv_heads)


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS)


EVAL_SAMPLES = 10


def eval_dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(12)
    ids = torch.randint(0, 127, (EVAL_SAMPLES, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def arguments(output_dir: str, per_device: int, save: bool, defaults: bool = False, **more: Any) -> Any:
    """The run's TrainingArguments: what defines it (steps, batch, learning rate, clipping below the gradient norm, a
    log per step, saves), everything else as transformers constructs it (no use_cpu: the CPU run is found as is);
    with ``defaults``, only the output folder."""
    from transformers import TrainingArguments

    if defaults:
        return TrainingArguments(output_dir=output_dir, **more)
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        learning_rate=3e-3,
        max_grad_norm=MAX_GRAD_NORM,
        logging_steps=1,
        save_strategy="steps" if save else "no",
        save_steps=2,
        **more,
    )


def reference_model(kv_heads: int, lora: bool) -> Any:
    from tests.support.models import reference_model as unsharded

    model = unsharded("llama", config(kv_heads), seed=0).train()
    if lora:
        from peft import get_peft_model

        torch.manual_seed(3)  # the adapters' initial values: the same draw in every run
        model = get_peft_model(model, lora_config())
        _nonzero_lora_b(model)
    return model


def _nonzero_lora_b(model: Any) -> None:
    """peft starts lora_B at zero; a seeded value makes the adapters' first gradients exercise both factors."""
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def _weights(model: Any) -> dict[str, torch.Tensor]:
    """The trained tensors as plain transformers names them (peft's trainable adapters, or every weight)."""
    if hasattr(model, "get_base_model"):
        from peft import get_peft_model_state_dict

        return {name: value.detach().clone() for name, value in get_peft_model_state_dict(model).items()}
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def reference(rank: int, world_size: int, runs: list[Run], workdir: str) -> dict[str, Any]:
    """Rank body (world 1): each distinct reference of ``runs``, a stock Trainer on the unsharded model."""
    from transformers import LlamaForCausalLM, Trainer

    results: dict[str, Any] = {}
    for run in runs:
        key = reference_key(run)
        if key in results:
            continue
        model = reference_model(run.kv_heads, bool(run.lora))
        recorder = _Recorder()
        output = str(Path(workdir) / f"reference-{key}")
        args = arguments(output, BATCH, save=not run.defaults, defaults=run.defaults, **_accumulation(run))
        trainer = Trainer(
            model=model, args=args, train_dataset=dataset(run.ignored), eval_dataset=eval_dataset(), callbacks=[recorder],
            **_object_metrics(run),
        )
        if run.gather_object:
            _gather_objects_in_every_loop(trainer)
        before = trainer.evaluate() if run.evaluate else None
        trained = trainer.train()
        result = {"steps": dict(recorder.steps), "weights": _weights(model), "training_loss": trained.training_loss}
        if run.evaluate:
            result["evaluated"] = _evaluated(run, trainer, before)
        if not run.lora and not run.defaults:  # the step-2 checkpoint as plain transformers loads it
            saved = LlamaForCausalLM.from_pretrained(str(Path(output) / "checkpoint-2"))
            result["checkpoint_2"] = {name: value.clone() for name, value in saved.state_dict().items()}
        results[key] = result
    return results


def reference_key(run: Run) -> str:
    accumulated = f"-accumulate{run.accumulate}" if run.accumulate > 1 else ""
    ignored = "-ignored" if run.ignored else ""
    objects = "-objects" if run.gather_object else ""
    return f"kv{run.kv_heads}{'-lora' if run.lora else ''}{'-defaults' if run.defaults else ''}{accumulated}{ignored}{objects}"


def _accumulation(run: Run) -> dict[str, Any]:
    """The run's TrainingArguments beyond ``arguments``': accumulation, and gathering evaluation objects."""
    more: dict[str, Any] = {"gradient_accumulation_steps": run.accumulate} if run.accumulate > 1 else {}
    if run.gather_object:  # the batches kept apart: a list of token rows per batch, not concatenated
        more.update(eval_use_gather_object=True, eval_do_concat_batches=False)
    return more


def _object_metrics(run: Run) -> dict[str, Any]:
    """The Trainer's arguments for predictions that are not one tensor (``run.gather_object``)."""
    if not run.gather_object:
        return {}
    return dict(preprocess_logits_for_metrics=token_rows, compute_metrics=token_checksum)


def token_rows(logits: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """Each row's predicted tokens, of a length set by its first label: predictions that are not one tensor, whose
    ranks' shapes differ (what eval_use_gather_object is for)."""
    return [row[: 1 + int(label[0]) % SEQ] for row, label in zip(logits.argmax(-1), labels)]


def token_checksum(prediction: Any) -> dict[str, float]:
    """How many tokens were predicted and a checksum of them and their places: any row missing, repeated, cut short or
    out of order changes it (batches kept apart)."""
    count = checksum = 0
    for rows in prediction.predictions:
        for row in rows:
            count += len(row)
            checksum += sum((place + 1) * int(token) for place, token in enumerate(row)) * (count % 97 + 1)
    return {"tokens": float(count), "checksum": float(checksum)}


def parity_table(references: dict[str, Any], runs: dict[str, Any], cases: list[Run]) -> list[tuple[str, float, float, float, float, list[int]]]:
    """Each case against its reference: the largest per-step loss and grad_norm differences, the train_loss difference
    and the final weights' largest difference, printed as a table; rows ``(name, loss, norm, mean, weights, steps)``."""
    rows = []
    for run in cases:
        reference = references[reference_key(run)]
        mine = runs[run.name]
        steps = sorted(mine["steps"])
        loss = max((abs(mine["steps"][s][0] - reference["steps"][s][0]) for s in steps), default=0.0)
        norm = max((abs(mine["steps"][s][1] - reference["steps"][s][1]) for s in steps), default=0.0)
        # a resumed run's train_loss is the mean of its own steps (3 and 4): not comparable
        mean = 0.0 if run.resume else abs(mine["training_loss"] - reference["training_loss"])
        weights = max((mine["weights"][k] - v).abs().max().item() for k, v in reference["weights"].items())
        rows.append((run.name, loss, norm, mean, weights, steps))
    print("\n| loop | max loss diff | max grad_norm diff | train_loss diff | final weights max diff |\n|---|---:|---:|---:|---:|")
    for name, loss, norm, mean, weights, _ in rows:
        print(f"| {name} | {loss:.1e} | {norm:.1e} | {mean:.1e} | {weights:.1e} |")
    return rows


def _gather_objects_in_every_loop(trainer: Any) -> None:
    """The one-process reference's ``eval_use_gather_object`` for every evaluation loop, not the first only.

    transformers binds the flag to the gather of the first loop and puts back the bare ``gather_for_metrics``
    after each (5.24, 5.25); a later loop then cuts every row of the last batch to the remainder's length, where
    the first loop keeps the rows whole. The reference is the first loop's behaviour in every loop.
    """
    import functools

    accelerator = trainer.accelerator
    accelerator.gather_for_metrics = functools.partial(accelerator.gather_for_metrics, use_gather_object=True)


def _evaluated(run: Run, trainer: Any, before: dict[str, float]) -> tuple:
    """``(eval_loss before training, after, predict's (predictions, labels))``; with ``run.gather_object`` the
    predictions as the token rows of every batch in order, and the metrics of them before and after."""
    after = trainer.evaluate()
    if not run.gather_object:
        return before["eval_loss"], after["eval_loss"], _predictions(trainer)
    output = trainer.predict(eval_dataset())
    rows = [[int(token) for token in row] for batch in output.predictions for row in batch]
    labels = torch.cat([torch.as_tensor(batch) for batch in output.label_ids])
    metrics = [{name: value for name, value in found.items() if name in ("eval_tokens", "eval_checksum")}
               for found in (before, after)]
    return before["eval_loss"], after["eval_loss"], (rows, labels), metrics


def _predictions(trainer: Any) -> Any:
    """trainer.predict's logits and labels on the eval set (gathered as transformers gathers them for metrics)."""
    output = trainer.predict(eval_dataset())
    return torch.as_tensor(output.predictions), torch.as_tensor(output.label_ids)


def _torchrun_environment(rank: int, world_size: int) -> None:
    """What torchrun sets, which accelerate reads to see a distributed CPU run."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
    )


def _mesh(run: Run) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    dims = [("dp", run.dp), ("pp", run.pp), ("tp", run.tp)]
    dims = [(name, size) for name, size in dims if size > 1] or [("tp", 1)]
    return init_device_mesh("cpu", tuple(size for _, size in dims), mesh_dim_names=tuple(name for name, _ in dims))


def parallel_model(run: Run, mesh: Any) -> Any:
    """The generated model with the reference's weights (and adapters), parallelized as ``run`` says."""
    from hpgen.runtime import parallelize
    from tests.support.models import generated_model, import_file

    base = reference_model(run.kv_heads, lora=False)
    if run.generated:
        model = generated_model(import_file(run.generated), "llama", config(run.kv_heads), base).train()
    else:  # a plan of pipeline stages alone: transformers' own class
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(config(run.kv_heads))
        model.load_state_dict(base.state_dict())
        model.train()
    if run.lora:
        from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

        adapters = get_peft_model_state_dict(reference_model(run.kv_heads, lora=True))
    if run.lora == "before":
        model = get_peft_model(model, lora_config())
        set_peft_model_state_dict(model, adapters)
        parallelize(model, run.plan, mesh, check_inputs=run.check_inputs)
    else:
        parallelize(model, run.plan, mesh, check_inputs=run.check_inputs)
        if run.lora == "after":
            model = get_peft_model(model, lora_config())
            set_peft_model_state_dict(model, adapters)  # full tensors: each rank keeps its slice
    if run.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def _full_weights(model: Any) -> dict[str, torch.Tensor]:
    """The unsharded tensors (every rank joins; rank 0 keeps them)."""
    if hasattr(model, "get_base_model"):
        return _weights(model)  # peft's state dict gathers the adapters whole
    from hpgen.runtime import full_state_dict

    return full_state_dict(model)


def parallel(rank: int, world_size: int, runs: list[Run], workdir: str) -> dict[str, Any]:
    """Rank body: each run in its loop; rank 0 returns its steps and gathered weights (or the error it stopped with)."""
    _torchrun_environment(rank, world_size)
    results: dict[str, Any] = {}
    meshes: dict[tuple[int, int, int], Any] = {}
    for run in runs:
        key = (run.dp, run.pp, run.tp)
        mesh = meshes.get(key) or meshes.setdefault(key, _mesh(run))
        model = parallel_model(run, mesh)
        if run.loop == "hpgen, no torchrun environment":  # torch.distributed as the spawner made it, and nothing else
            saved = {name: os.environ.pop(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
            try:
                result = _refused(run, model, workdir, rank)
            finally:
                os.environ.update(saved)
        else:
            result = _train(run, model, workdir) if run.loop == "hpgen" else _refused(run, model, workdir, rank)
        if rank == 0:
            results[run.name] = result
    return results


def _train(run: Run, model: Any, workdir: str) -> dict[str, Any]:
    from hpgen.runtime.trainer import Trainer

    recorder = _Recorder()
    output = str(Path(workdir) / (run.resume or run.name))
    args = arguments(output, BATCH // run.dp, run.save, defaults=run.defaults, **_accumulation(run))
    pipeline = dict(pipeline_microbatches=run.microbatches, pipeline_schedule=run.schedule) if run.pp > 1 else {}
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset(run.ignored), eval_dataset=eval_dataset(), callbacks=[recorder],
        **pipeline, **_object_metrics(run),
    )
    before = trainer.evaluate() if run.evaluate else None
    trained = trainer.train(resume_from_checkpoint=str(Path(output) / "checkpoint-2") if run.resume else None)
    result = {"steps": dict(recorder.steps), "weights": _full_weights(model), "training_loss": trained.training_loss}
    if run.evaluate:
        result["evaluated"] = _evaluated(run, trainer, before)
    if run.save:
        result["checkpoint_2"] = str(Path(output) / "checkpoint-2")
    return result


def _refused(run: Run, model: Any, workdir: str, rank: int) -> dict[str, Any]:
    """What hpgen's Trainer must refuse before its first optimizer step (another mesh's checkpoint, accelerate not
    seeing the run): the error (the same on every rank: all of them are returned) and how far the weights moved from
    the reference's (0: the shards are unchanged and no step was taken)."""
    import torch.distributed as dist

    from hpgen.runtime.trainer import Trainer

    error = None
    try:
        if run.loop == "hpgen, another mesh":  # resume a checkpoint written on another mesh
            output = str(Path(workdir) / run.resume)
            trainer = Trainer(model=model, args=arguments(output, BATCH // run.dp, False), train_dataset=dataset())
            trainer.train(resume_from_checkpoint=str(Path(output) / "checkpoint-2"))
        else:  # "hpgen, no torchrun environment"
            Trainer(model=model, args=arguments(str(Path(workdir) / run.name), BATCH, False), train_dataset=dataset()).train()
    except Exception as caught:  # noqa: BLE001 - the test reads the message
        error = f"{type(caught).__name__}: {caught}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    initial = reference_model(run.kv_heads, lora=False).state_dict()
    weights = _full_weights(model)
    drift = max((weights[name] - initial[name]).abs().max().item() for name in initial) if rank == 0 else None
    return {"errors": errors, "drift": drift}


def ddp_over_three_of_four(rank: int, world_size: int, run: Run, workdir: str) -> dict[str, Any]:
    """Rank body (4 ranks, dp 2 x tp 2): ``DistributedDataParallel(model, process_group=<ranks 0, 1, 2>)`` on ranks
    0-2 (rank 3 is outside it). The tp group {0, 1} lies inside that DDP; {2, 3} has one rank in it. Every rank of the
    DDP must decide alike (refuse) and none wait in a collective the others skip. Returns every rank's error and how
    far rank 0's weights moved (rank 0)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    mesh = _mesh(run)
    model = parallel_model(run, mesh)
    subset = dist.new_group([0, 1, 2])  # every rank makes every group
    error = None
    if rank in (0, 1, 2):
        batch = torch.stack([row["input_ids"] for row in dataset()[:BATCH]])
        try:
            DistributedDataParallel(model, process_group=subset)(input_ids=batch, labels=batch)
        except Exception as caught:  # noqa: BLE001 - the test reads the message
            error = f"{type(caught).__name__}: {caught}"
    errors = [None] * world_size
    dist.all_gather_object(errors, error)
    initial = reference_model(run.kv_heads, lora=False).state_dict()
    weights = _full_weights(model)
    drift = max((weights[name] - initial[name]).abs().max().item() for name in initial) if rank == 0 else None
    return {"errors": errors, "drift": drift}


def docs_block(rank: int, world_size: int, folder: str) -> str:
    """Rank body: docs/training.md's Trainer block, written to ``folder/finetune.py``, run there as under torchrun."""
    import sys

    from tests.scripts.test_examples import _as_under_torchrun

    os.chdir(folder)  # the block reads ckpt/ and plan.json and writes out/ where it is run
    sys.path.insert(0, folder)  # and imports modeling_llama_tp from there
    return _as_under_torchrun(rank, world_size, "finetune.py")


def docs_reference(rank: int, world_size: int, folder: str, arguments: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Rank body (world 1): the block's training, a stock Trainer on the unsharded checkpoint in one process, with the
    block's data and ``arguments`` (as the block writes them); returns the final weights."""
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    full = LlamaForCausalLM.from_pretrained(str(Path(folder) / "ckpt"))
    rows = torch.randint(0, full.config.vocab_size, (64, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in rows]
    args = TrainingArguments(**{**arguments, "output_dir": str(Path(folder) / "reference")})
    Trainer(model=full, args=args, train_dataset=data).train()
    return {name: value.detach().clone() for name, value in full.state_dict().items()}
