"""Stock training loops handed a parallelized model, for ``test_stock_loops.py``: each must stop before a step.

Every case builds the tiny Llama of ``tests.support.trainer_runs`` parallelized (tp 2, or dp 2 x
tp 2) and runs one stock loop on it as a user would write it: transformers' ``Trainer`` in each
configuration (its defaults, ``use_cpu``, accelerate's ``ParallelismConfig``, ``fsdp=``, the model
presenting transformers' tensor-parallel attributes, resuming a checkpoint, a peft model), or
accelerate's ``Accelerator().prepare`` (its defaults, ``cpu=True``, an FSDP plugin, and its
tensor-parallel, FSDP and FSDP2 preparations with the state set as on GPUs), or a DDP whose ignore
list was replaced; and hpgen's own Trainer asked for accelerate's sharding (``fsdp=``,
``parallelism_config=``). Each rank returns the error it stopped with; rank 0 also how far the
weights moved from the ones loaded (0: unchanged).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.support.trainer_runs import BATCH, MAX_GRAD_NORM, Run, arguments, dataset, parallel_model, reference_model


@dataclass(frozen=True)
class Case:
    """One stock loop: which (``loop``), how it is set up (``variant``), and the model (``run``'s plan, mesh, LoRA)."""

    name: str
    loop: str  # "trainer", "accelerate", "ddp, ignore list replaced"; "hpgen trainer": what hpgen's Trainer refuses
    variant: str = ""
    arguments: dict = field(default_factory=dict)  # TrainingArguments beyond trainer_runs.arguments'
    run: Run | None = None


def checkpoint(folder: Path) -> str:
    """A checkpoint as a stock Trainer writes one, holding other weights than the cases' model: if a resume loaded it,
    the weights would move."""
    from transformers.trainer_callback import TrainerState

    from tests.support.models import reference_model as unsharded
    from tests.support.trainer_runs import config

    folder.mkdir(parents=True, exist_ok=True)
    unsharded("llama", config(), seed=5).save_pretrained(str(folder))
    TrainerState(global_step=2, max_steps=4).save_to_json(str(folder / "trainer_state.json"))
    return str(folder)


def stopped(rank: int, world_size: int, cases: list[Case], workdir: str) -> dict[str, Any]:
    """Rank body: each case in turn; every rank's error and, on rank 0, the weights' largest move."""
    import torch.distributed as dist

    from tests.support.trainer_runs import _mesh, _torchrun_environment

    _torchrun_environment(rank, world_size)
    results: dict[str, Any] = {}
    meshes: dict[tuple[int, int], Any] = {}
    for case in cases:
        run = case.run
        key = (run.dp, run.tp)
        mesh = meshes.get(key) or meshes.setdefault(key, _mesh(run))
        model = parallel_model(run, mesh)
        error = None
        try:
            _stock_loop(case, model, workdir)
        except Exception as caught:  # noqa: BLE001 - the test reads the message
            error = f"{type(caught).__name__}: {caught}"
        errors: list[Any] = [None] * world_size
        dist.all_gather_object(errors, error)
        drift = _drift(model, run)
        if rank == 0:
            results[case.name] = {"errors": errors, "drift": drift}
    return results


def _drift(model: Any, run: Run) -> float | None:
    """How far the model's weights (or its adapters) moved from those it was built with (rank 0; every rank joins)."""
    import torch.distributed as dist

    from tests.support.trainer_runs import _full_weights

    if run.lora:
        from peft import get_peft_model_state_dict

        initial = get_peft_model_state_dict(reference_model(run.kv_heads, lora=True))
    else:
        initial = reference_model(run.kv_heads, lora=False).state_dict()
    weights = _full_weights(model)
    if dist.get_rank() != 0:
        return None
    return max((weights[name] - initial[name]).abs().max().item() for name in initial)


def _stock_loop(case: Case, model: Any, workdir: str) -> None:
    if case.variant == "tp attributes":  # what transformers' from_pretrained(distributed_config=...) leaves
        from transformers.distributed import DistributedConfig

        model._tp_size = case.run.tp
        model.config.distributed_config = DistributedConfig(tp_size=case.run.tp)
    if case.variant == "loaded sharded":
        model._is_distributed_loading_by_transformers = True
    if case.loop in ("trainer", "hpgen trainer"):
        _trainer(case, model, workdir)
    elif case.loop == "accelerate":
        _accelerate(case, model)
    else:
        _ddp_with_its_ignore_list_replaced(model)


def _trainer(case: Case, model: Any, workdir: str) -> None:
    if case.loop == "hpgen trainer":
        from hpgen.runtime.trainer import Trainer
    else:
        from transformers import Trainer

    extra = dict(case.arguments)
    if extra.pop("parallelism_config", None):
        from accelerate import ParallelismConfig

        extra["parallelism_config"] = ParallelismConfig(tp_size=case.run.tp)
    args = arguments(str(Path(workdir) / case.name), BATCH // case.run.dp, False, **extra)
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    resume = str(Path(workdir) / "stock-checkpoint") if case.variant == "resume" else None
    trainer.train(resume_from_checkpoint=resume)


def _accelerate(case: Case, model: Any) -> None:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    cpu = case.variant in ("cpu=True", "FSDP2 plugin")
    plugin = None
    if case.variant == "FSDP2 plugin":  # what a user passes; on the CPU accelerate leaves it unused
        from accelerate import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=cpu, fsdp_plugin=plugin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(dataset(), batch_size=BATCH)
    with _as_on_gpus(accelerator, case):
        if case.variant == "prepare_model":
            wrapped = accelerator.prepare_model(model)
            optimizer = accelerator.prepare(optimizer)
        else:
            wrapped, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for batch in loader:
            accelerator.backward(wrapped(**batch).loss)
            accelerator.clip_grad_norm_(wrapped.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            break


@contextlib.contextmanager
def _as_on_gpus(accelerator: Any, case: Case) -> Iterator[None]:
    """accelerate's state for the preparations it makes only on accelerators (its tensor parallelism, FSDP, FSDP2),
    set on the CPU: what ``Accelerator.prepare`` would then do to the model is what a GPU run does. Put back after
    (accelerate's state is the process's: the next case starts from its own)."""
    from accelerate import FullyShardedDataParallelPlugin, ParallelismConfig
    from accelerate.utils import DistributedType

    state = accelerator.state
    saved = {name: getattr(state, name, None) for name in ("parallelism_config", "distributed_type", "fsdp_plugin")}
    if case.variant == "ParallelismConfig state":
        state.parallelism_config = ParallelismConfig(tp_size=case.run.tp)
    elif case.variant in ("FSDP state", "FSDP2 state"):
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2 if case.variant == "FSDP2 state" else 1)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(state, name, value)


def _ddp_with_its_ignore_list_replaced(model: Any) -> None:
    """DDP told to skip nothing: its constructor broadcasts the shards."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # uneven shards (127 vocabulary rows, 89 MLP columns) would fail DDP's own shape check on one rank only (and hang
    # the other): the user lists those, DDP broadcasts the even ones
    shapes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, {name: tuple(p.shape) for name, p in model.named_parameters()})
    uneven = [name for name in shapes[0] if len({tuple(other[name]) for other in shapes}) > 1]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, uneven)
    batch = torch.stack([row["input_ids"] for row in dataset()[:BATCH]])
    DistributedDataParallel(model)(input_ids=batch, labels=batch)
