"""LoRA fine-tuning on 2 gloo ranks against peft's LoRA on the unsharded transformers model.

Each case builds the unsharded reference (weights perturbed), puts peft's LoRA on it with
``lora_B`` perturbed too (peft starts it at zero, which would hide every wrong ``lora_A``
gradient), and the same on a model from the generated file, parallelized before or after
``get_peft_model`` (``order``). Both train a few optimizer steps in train mode on the same
batches: the loss at every step, every adapter gradient after the first backward (this
rank's slice, by the layout written here independently of hpgen) and every adapter after
the last step are compared; the replicated adapters are returned so that the test can
check that the ranks hold the same values.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tests.support.models import expected_shard, import_file, perturb_, tolerance

STEPS = 3
LR = 0.5


@dataclass(frozen=True)
class LoraCase:
    """One LoRA comparison: the family's reference builder, its generated file and plan, the peft config."""

    name: str
    family: str  # a key of tests/support/models.FAMILIES, or one of DERIVED (tests/support/derived_configs)
    generated: str
    plan: dict[str, Any]
    targets: tuple[str, ...]
    order: str = "parallelize_first"  # or "peft_first" (parallelize(peft_model)), "peft_base" (its base model)
    config: dict[str, Any] = field(default_factory=dict)  # overrides of the family's tiny config
    peft: dict[str, Any] = field(default_factory=dict)  # extra LoraConfig keywords
    lifecycle: bool = False  # also save / load / merge / DCP (tests/support/lora_lifecycle.py)
    tuner: str = "lora"  # or "ia3": another peft method, which is refused
    masks: bool = False  # only record the adapters' dropout masks, ranks seeded apart (see dropout_masks)


@dataclass
class LoraResult:
    losses: list[float]
    reference_losses: list[float]
    grad_failures: list[str]
    grads_checked: int
    param_failures: list[str]
    replicated: dict[str, list[float]]  # adapter name -> its first values (replicated ones)
    error: str | None = None  # a ParallelizeError's message, for the refusal cases
    lifecycle: dict[str, Any] = field(default_factory=dict)
    masks: dict[str, list[bool]] = field(default_factory=dict)  # adapter dropout -> its first mask bits


DERIVED = ("gpt2", "falcon")  # families whose tiny config is tests/support/derived_configs' (multi-query Falcon)


def family_config(family: str, overrides: dict[str, Any]) -> Any:
    """The tiny config of ``family`` (GPT-2's and Falcon's from tests/support/derived_configs) with ``overrides``."""
    if family in DERIVED:
        from tests.support.derived_configs import tiny

        config = tiny(family)
        for key, value in overrides.items():
            setattr(config, key, value)
        return config
    from tests.support.models import make_config

    return make_config(family, **overrides)


def _reference(family: str, config: Any, seed: int) -> nn.Module:
    if family in DERIVED:
        from hpgen.planner.model.load import model_class_for

        torch.manual_seed(seed)
        model = model_class_for(config)(config)
        perturb_(model, seed)
        return model
    from tests.support.models import reference_model

    return reference_model(family, config, seed)


def _model_class(module: Any, family: str) -> type:
    from tests.support.models import FAMILIES

    derived = {"gpt2": "GPT2LMHeadModel", "falcon": "FalconForCausalLM"}
    return getattr(module, derived[family] if family in derived else FAMILIES[family].model)


def lora_config(case: LoraCase) -> Any:
    from peft import IA3Config, LoraConfig

    if case.tuner == "ia3":
        return IA3Config(target_modules=list(case.targets), feedforward_modules=[])
    options = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": list(case.targets), **case.peft}
    return LoraConfig(**options)


def peft_reference(case: LoraCase, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(the unsharded base, the unsharded peft model with perturbed adapters), in train mode."""
    from peft import get_peft_model

    config = family_config(case.family, case.config)
    base = _reference(case.family, config, seed)
    reference = get_peft_model(copy.deepcopy(base), lora_config(case))
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return base, reference.train()


def sharded_peft(case: LoraCase, base: nn.Module, adapters: dict[str, torch.Tensor], mesh: Any) -> nn.Module:
    """The generated model with ``base``'s weights and the ``adapters``, parallelized in ``case.order``."""
    from peft import get_peft_model, set_peft_model_state_dict

    from hpgen.runtime import parallelize

    model = fresh_generated(case, base)
    if case.order == "parallelize_first":
        parallelize(model, case.plan, mesh)
        peft_model = get_peft_model(model, lora_config(case))
        set_peft_model_state_dict(peft_model, adapters)  # full tensors: each rank keeps its slice
    else:  # "peft_first": the peft model itself, or "peft_base": its get_base_model()
        peft_model = get_peft_model(model, lora_config(case))
        set_peft_model_state_dict(peft_model, adapters)
        parallelize(peft_model if case.order == "peft_first" else peft_model.get_base_model(), case.plan, mesh)
    return peft_model.train()


def fresh_generated(case: LoraCase, base: nn.Module) -> nn.Module:
    """A model of the generated file holding ``base``'s weights."""
    model = _model_class(import_file(case.generated), case.family)(base.config)
    model.load_state_dict(base.state_dict())
    return model


def adapter_layout(base_placement: str, part: str, *, transposed: bool) -> str:
    """The placement of ``lora_A``/``lora_B`` (weight or bias) for a base weight placed ``base_placement``:
    the base's output dim is ``lora_B``'s dim 0, its input dim ``lora_A``'s dim 1; the other one replicated."""
    text = base_placement.replace(" ", "")
    if text == "R":
        return "R"
    kind, _, rest = text.partition("(")
    args = rest.rstrip(")").split(",")
    column = int(args[0]) % 2 == (1 if transposed else 0)  # the base's outputs are sharded
    if (part == "lora_A") == column:
        return "R"
    return f"{kind}({','.join([('1' if part == 'lora_A' else '0'), *args[1:]])})"


def expected_layouts(reference: nn.Module, plan: dict[str, Any]) -> dict[str, str]:
    """Adapter parameter name (as peft names it) -> its placement on ``tp``, from the base weights' plan."""
    from hpgen.core.plan import fqn_matches

    base_layouts = {}
    base = reference.get_base_model()
    for fqn, _ in base.named_modules():
        for key, entry in plan["param_plan"].items():
            if fqn and fqn_matches(key, fqn):
                for name, layout in entry.get("params", {}).items():
                    base_layouts[f"{fqn}.{name}"] = layout.get("tp", "R")
    found = {}
    for name, module in reference.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        inner = name[len("base_model.model.") :]
        placement = base_layouts.get(f"{inner}.weight", "R")
        transposed = bool(getattr(module, "fan_in_fan_out", False))
        for part in ("lora_A", "lora_B"):
            for adapter, linear in getattr(module, part).items():
                for attr, _ in linear.named_parameters():
                    found[f"{name}.{part}.{adapter}.{attr}"] = adapter_layout(placement, part, transposed=transposed)
    return found


def run_lora_case(case: LoraCase, mesh: Any, workdir: str) -> LoraResult:
    from peft import get_peft_model_state_dict

    from hpgen.runtime.errors import ParallelizeError

    if case.masks:
        return dropout_masks(case, mesh)
    rank, size = mesh.get_local_rank("tp"), mesh.size(0)
    base, reference = peft_reference(case)
    adapters = get_peft_model_state_dict(reference)
    try:
        model = sharded_peft(case, base, adapters, mesh)
        ids = lora_batches(base.config.vocab_size)
        model(ids[0])  # the adapters of "parallelize_first" may be adopted here, if not at loading
    except ParallelizeError as error:
        return LoraResult([], [], [], 0, [], {}, error=str(error))
    layouts = expected_layouts(reference, case.plan)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    mine = dict(model.named_parameters())
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    ref_optimizer = torch.optim.SGD(trainable, lr=LR, momentum=0.9)
    losses, ref_losses, grad_failures, checked = [], [], [], 0
    for step, batch in enumerate(ids):
        loss = model(batch, labels=batch).loss
        ref_loss = reference(batch, labels=batch).loss
        loss.backward()
        ref_loss.backward()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        if step == 0:
            for name, placement in layouts.items():
                ref_grad = dict(reference.named_parameters())[name].grad
                grad = mine[name].grad
                if grad is None:
                    grad_failures.append(f"{name}: no gradient")
                    continue
                want = expected_shard(ref_grad, placement, rank, size)
                checked += 1
                if grad.shape != want.shape or not (grad - want).abs().max().item() <= tolerance(ref_grad):
                    err = (grad - want).abs().max().item() if grad.shape == want.shape else grad.shape
                    grad_failures.append(f"{name} ({placement}): {err}")
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    param_failures, replicated = [], {}
    ref_params = dict(reference.named_parameters())
    for name, placement in layouts.items():
        want = expected_shard(ref_params[name].detach(), placement, rank, size)
        got = mine[name].detach()
        if got.shape != want.shape or not (got - want).abs().max().item() <= tolerance(want):
            param_failures.append(f"{name} ({placement})")
        if placement == "R":
            replicated[name] = got.flatten()[:8].tolist()
    result = LoraResult(losses, ref_losses, grad_failures, checked, param_failures, replicated)
    if case.lifecycle:
        from tests.support.lora_lifecycle import lifecycle

        result.lifecycle = lifecycle(case, model, reference, base, optimizer, mesh, workdir)
    return result


def dropout_masks(case: LoraCase, mesh: Any) -> LoraResult:
    """One train-mode forward with the ranks' global seeds apart: each adapter dropout's mask (its first bits).

    A column-parallel layer's input is replicated: its mask must be the same on every rank (the
    rank's B then sees the same dropped input as the others'); a row-parallel layer's input is
    sharded: each rank draws its own.
    """
    import torch.distributed as dist
    from peft import get_peft_model_state_dict

    base, reference = peft_reference(case)
    model = sharded_peft(case, base, get_peft_model_state_dict(reference), mesh)
    masks: dict[str, list[bool]] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            masks[name] = (output != 0).flatten()[:64].tolist()

        return hook

    for name, module in model.named_modules():
        if name.endswith("lora_dropout.default"):
            module.register_forward_hook(record(name))
    torch.manual_seed(1000 + dist.get_rank())  # the ranks' own seeds differ, as in a data-parallel job
    batch = lora_batches(base.config.vocab_size)[0]
    loss = model(batch, labels=batch).loss
    return LoraResult([loss.item()], [], [], len(masks), [], {}, masks=masks)


def lora_batches(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (2, 7), generator=generator) for _ in range(STEPS)]


def run_lora_cases(rank: int, world_size: int, cases: list[LoraCase], workdir: str) -> dict[str, LoraResult]:
    """Rank body for ``run_distributed``: every case on a 1-D ``tp`` mesh of all ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    return {case.name: run_lora_case(case, mesh, workdir) for case in cases}


def run_lora_fsdp_case(case: LoraCase, mesh: Any) -> LoraResult:
    """``case`` on a ``dp x tp`` mesh: peft, then ``parallelize`` on ``tp``, then FSDP2 on ``dp`` (torchtitan's
    order: each decoder layer, then the root); each ``dp`` rank trains on its share of the batch.

    The losses (averaged over ``dp``) and, after the steps, every adapter (FSDP2's ``dp`` pieces gathered:
    this ``tp`` rank's slice) are compared with peft's LoRA on the whole batch on one process.
    """
    import torch.distributed as dist
    from peft import get_peft_model_state_dict
    from torch.distributed.fsdp import fully_shard

    base, reference = peft_reference(case)
    model = sharded_peft(case, base, get_peft_model_state_dict(reference), mesh)
    for layer in model.get_base_model().model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp, dp_rank = mesh["dp"].size(), mesh.get_local_rank("dp")
    tp, tp_rank = mesh["tp"].size(), mesh.get_local_rank("tp")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    ref_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    losses, ref_losses = [], []
    for batch in lora_batches(base.config.vocab_size):
        rows = batch[dp_rank * len(batch) // dp : (dp_rank + 1) * len(batch) // dp]
        loss = model(rows, labels=rows).loss
        loss.backward()
        ref_loss = reference(batch, labels=batch).loss
        ref_loss.backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        losses.append(mean.item() / dp)
        ref_losses.append(ref_loss.item())
    layouts = expected_layouts(reference, case.plan)
    mine, ref_params = dict(model.named_parameters()), dict(reference.named_parameters())
    failures, replicated = [], {}
    for name, placement in layouts.items():
        got = mine[name].full_tensor().detach()  # FSDP2's dp pieces: this tp rank's adapter
        want = expected_shard(ref_params[name].detach(), placement, tp_rank, tp)
        if got.shape != want.shape or not (got - want).abs().max().item() <= tolerance(want):
            failures.append(f"{name} ({placement})")
        if placement == "R":
            replicated[name] = got.flatten()[:8].tolist()
    return LoraResult(losses, ref_losses, [], len(layouts), failures, replicated)


def run_lora_fsdp_cases(rank: int, world_size: int, cases: list[LoraCase]) -> dict[str, LoraResult]:
    """Rank body: every case on a ``dp`` 2 x ``tp`` 2 mesh (4 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {case.name: run_lora_fsdp_case(case, mesh) for case in cases}
