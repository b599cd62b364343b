"""Fine-tuning with transformers' Trainer on a tensor-parallel Llama: ``hpgen.runtime.trainer.Trainer``.

    torchrun --nproc-per-node 2 examples/trainer_finetune.py   # tp 2
    torchrun --nproc-per-node 4 examples/trainer_finetune.py   # dp 2 x tp 2 (DDP on dp)

Runs on CPUs with gloo (or GPUs with NCCL when CUDA is available); nothing is
downloaded. Every rank:

1. writes the plan with ``hpgen plan``'s translator (``--tp 2``), lowers the installed
   ``modeling_llama.py`` with it and imports the generated file;
2. builds the model from it with the weights of an unsharded reference and calls
   ``parallelize`` on the ``tp`` axis of a ``dp x tp`` mesh;
3. trains it with ``hpgen.runtime.trainer.Trainer`` (transformers' ``TrainingArguments``,
   clipping at ``max_grad_norm=0.5``, below the gradient norm), which shards the data over
   ``dp`` only, wraps the model in DDP on ``dp`` only and clips by the whole model's norm;
4. prints each step's logged loss and ``grad_norm`` beside those of the same steps taken by
   the unsharded model on one process (AdamW, the linear schedule, torch's clipping: the
   Trainer's defaults);
5. saves the model (every rank joins, rank 0 writes), loads it back with plain
   transformers on rank 0 and compares its logits with the parallelized model's, and its
   weights with the unsharded model's after the same steps.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from hpgen.generator.lower import lower
from hpgen.core.plan import plan_from_dict
from hpgen.planner.model.load import meta_model
from hpgen.planner.translate.translator import translated_plan
from hpgen.runtime import parallelize
from hpgen.runtime.trainer import Trainer

CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
TP, STEPS, BATCH, SEQ, LR, MAX_GRAD_NORM = 2, 5, 4, 32, 1e-3, 0.5


def lower_llama(plan: dict, directory: Path) -> object:
    """Lower the installed modeling_llama.py under ``plan`` and import the generated file."""
    source = Path(importlib.util.find_spec("transformers.models.llama.modeling_llama").origin)
    text = lower(
        source.read_text(),
        plan_from_dict(plan, name="trainer_plan.json"),
        source_name=source.name,
        package="transformers.models.llama",
    )
    path = directory / "modeling_llama_tp.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("modeling_llama_tp", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def unsharded_steps(model: LlamaForCausalLM, rows: torch.Tensor) -> list[tuple[float, float]]:
    """The Trainer's steps on one process: AdamW, linear decay to zero, torch's clipping, batches in order."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (STEPS - step) / STEPS)
    steps = []
    for step in range(STEPS):
        batch = rows[step * BATCH : (step + 1) * BATCH]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        steps.append((loss.item(), norm.item()))
    return steps


class PrintSteps(TrainerCallback):
    """Prints each logged step beside the unsharded model's (rank 0)."""

    def __init__(self, reference: list[tuple[float, float]]) -> None:
        self.reference = reference

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if state.is_world_process_zero and logs and "grad_norm" in logs:
            loss, norm = self.reference[state.global_step - 1]
            print(
                f"step {state.global_step}: loss {logs['loss']:.6f} grad_norm {logs['grad_norm']:.6f}  "
                f"(unsharded model, one process: {loss:.6f} {norm:.6f})"
            )


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % TP:
        raise SystemExit(f"run with a multiple of {TP} processes (tp = {TP}), e.g. --nproc-per-node 2 or 4")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world // TP, TP), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].size()

    config = LlamaConfig(**CONFIG)
    plan = translated_plan(meta_model(config), tp=TP, name="llama")
    # kept until the end: parallelize reads the generated file's header to check that all ranks run the same code
    directory = tempfile.TemporaryDirectory(prefix=f"hpgen-rank{rank}-")
    generated = lower_llama(plan, Path(directory.name))

    torch.manual_seed(0)  # the same reference weights on every rank
    reference = LlamaForCausalLM(config).to(device)
    model = generated.LlamaForCausalLM(config).to(device)
    model.load_state_dict(reference.state_dict())
    parallelize(model, plan, mesh)  # tp: hpgen's collectives; the mesh's dp axis is left to the Trainer (DDP)

    rows = torch.randint(0, config.vocab_size, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    trained = copy.deepcopy(reference)
    expected = unsharded_steps(trained, rows.to(device))

    shared = [tempfile.mkdtemp(prefix="hpgen-trainer-") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)  # one output folder for every rank
    args = TrainingArguments(
        output_dir=shared[0],
        max_steps=STEPS,
        per_device_train_batch_size=BATCH // dp,  # each dp rank its share of the batch
        learning_rate=LR,
        max_grad_norm=MAX_GRAD_NORM,
        train_sampling_strategy="sequential",  # the batches in order, as the reference takes them
        logging_steps=1,
        save_strategy="no",
    )  # nothing about the device: on CPUs the Trainer sets accelerate up for the mesh's gloo run itself
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[PrintSteps(expected)])
    trainer.train()

    final = os.path.join(shared[0], "final")
    trainer.save_model(final)  # every rank joins the gather; rank 0 writes
    dist.barrier()
    if rank == 0:
        saved = LlamaForCausalLM.from_pretrained(final)
        with torch.no_grad():
            err = (saved.to(device)(rows[:2].to(device)).logits - model.eval()(rows[:2].to(device)).logits).abs()
        weights = max((saved.state_dict()[k].to(device) - v).abs().max().item() for k, v in trained.state_dict().items())
        print(f"{world} ranks as dp {dp} x tp {TP}: saved model loaded by transformers, logits max |diff| "
              f"{err.max().item():.3g}; its weights vs the unsharded model's after the same steps: {weights:.3g}")
    else:
        with torch.no_grad():
            model.eval()(rows[:2].to(device))  # the forward runs collectives: every rank joins rank 0's
    dist.barrier()
    dist.destroy_process_group()
    directory.cleanup()


if __name__ == "__main__":
    main()
