"""Train mode and sampling as users run them, on 2 gloo ranks seeded ``torch.manual_seed(1234 + rank)``.

GPT-2, OPT and BioGPT with the plans of ``hpgen plan --tp 2`` and every dropout at 0.1, Llama with
``attention_dropout`` 0.1 and biases (its plan from ``hpgen plan`` too), GPT-NeoX and GPT-J (one
summed reduction a layer) with every dropout at 0.1, all with transformers' defaults (sdpa
attention). One spawn runs everything; the tests read its report:

- the residual stream entering the final norm is the same on both ranks, bit for bit, at every
  step (dropout on replicated values draws one stream), and every parameter the plan keeps
  replicated is the same on both ranks after the steps (AdamW);
- at every position where GPT-2's ``resid_dropout(c_proj(x))`` zeroes its (partial) input, the
  attention's reduced output is zero too: the deferred bias is dropped with it;
- attention dropout on the sharded heads draws its own numbers on each rank (GPT-2 eager);
- the mean loss of 20 steps lies within the spread of the unsharded model trained from 4 seeds;
- ``gradient_checkpointing_enable()`` (GPT-2 TP, Llama SP, GPT-NeoX's paired norms) gives the gradients of the same
  step without it: the recompute redraws the same masks; ``torch.autocast`` and a bf16 model
  keep the stream equal;
- ``generate`` with sampling (top_k, top_p, temperature, repetition_penalty) and with beam
  sampling gives the same tokens on both ranks, and leaves each rank's own RNG where it was;
  with one seed everywhere, the unsharded model's tokens;
- ranks fed different inputs stop on their first forward, every rank with the same error.
"""

from __future__ import annotations

import copy
import inspect
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed

DROPOUT = 0.1
STEPS = 20
REFERENCE_SEEDS = (0, 1, 2, 3)  # ranks 0 and 1 train the unsharded model from two each
OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt2": dict(resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT),
    "opt": dict(dropout=DROPOUT, attention_dropout=DROPOUT, activation_dropout=DROPOUT),
    "llama": dict(attention_dropout=DROPOUT, attention_bias=True, mlp_bias=True),
    # parallel-residual blocks under the summed reduction: the dropouts of the branches' partial outputs
    # (GPT-NeoX's post_attention_dropout, post_mlp_dropout) draw one stream, the biases inside them on one rank
    "gpt_neox": dict(hidden_dropout=DROPOUT, attention_dropout=DROPOUT),
    "gptj": dict(resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT),
    # fc1's 89 outputs split 45 / 44 and its activation dropout runs between fc1 and fc2 (wrapped linears of the
    # decoder layer): a different count of draws on each rank, which must not come from the replicated stream
    "biogpt": dict(hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT, activation_dropout=DROPOUT),
}
FAMILIES = tuple(OVERRIDES)
# trained with --sp as well (case "<family>_sp"): a summed block whose two norms' outputs are gathered as one pair
SP_TRAINED = ("gpt_neox",)
TRAINED = FAMILIES + tuple(f"{family}_sp" for family in SP_TRAINED)


def _config(family: str) -> Any:
    if family == "biogpt":
        import transformers

        shape = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=89)
        return transformers.BioGptConfig(vocab_size=127, max_position_embeddings=64, **shape, **OVERRIDES[family])
    if family == "llama":
        from tests.support.models import make_config

        return make_config("llama", **OVERRIDES[family])
    from tests.support.derived_configs import tiny

    config = tiny(family)
    for key, value in OVERRIDES[family].items():
        setattr(config, key, value)
    return config


def _lowered(family: str, directory: Path, *, sp: bool = False) -> tuple[dict, str]:
    """What ``hpgen plan CONFIG --tp 2 [--sp]`` writes for the family, and the file ``hpgen lower`` makes of it."""
    from hpgen.generator.generate import infer_package
    from hpgen.generator.lower import lower
    from hpgen.core.plan import plan_from_dict
    from hpgen.planner.model.load import meta_model, model_class_for
    from hpgen.planner.entry.make import plan_model

    config = _config(family)
    plan = plan_model(meta_model(config), tp=2, sp=sp, name=family)
    source = Path(inspect.getsourcefile(model_class_for(config)) or "")
    text = lower(source.read_text(), plan_from_dict(plan), source_name=source.name, package=infer_package(source))
    path = directory / f"{family}{'_sp' if sp else ''}_train.py"
    path.write_text(text)
    return plan, str(path)


def _models(family: str, plan: dict, generated: str, mesh: Any, **config: Any) -> tuple[Any, Any]:
    """The unsharded model and the parallelized one, same weights; then this rank's own seed."""
    from hpgen.planner.model.load import model_class_for
    from hpgen.runtime import parallelize
    from tests.support.models import import_file, perturb_

    cfg = _config(family)
    for key, value in config.items():
        setattr(cfg, key, value)
    cls = model_class_for(cfg)
    torch.manual_seed(0)
    reference = cls(cfg)
    perturb_(reference, 0, scale=0.02)
    model = getattr(import_file(generated), cls.__name__)(cfg)
    model.load_state_dict(reference.state_dict())
    torch.manual_seed(1234 + torch.distributed.get_rank())  # as data-loading code commonly does
    parallelize(model, plan, mesh)
    return reference, model


def _final_norm(model: Any) -> Any:
    names = ("transformer.ln_f", "model.decoder.final_layer_norm", "model.norm", "gpt_neox.final_layer_norm", "biogpt.layer_norm")
    return next(module for name, module in model.named_modules() if name in names)


def _batches(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)  # the same batches on every rank and for every model
    return [torch.randint(0, vocab, (2, 12), generator=generator) for _ in range(STEPS)]


def _spread(tensor: torch.Tensor) -> float:
    """max |rank 0 - rank 1| of a tensor both ranks hold."""
    import torch.distributed as dist

    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor.detach().contiguous())
    return max((piece - pieces[0]).abs().max().item() for piece in pieces)


def _train(model: Any, batches: list[torch.Tensor], *, watch: Any = None) -> list[float]:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _family_report(case: str, plan: dict, generated: str, mesh: Any) -> dict[str, Any]:
    """Train ``case`` 20 steps; the replicated values' spread over the ranks, and the losses beside the unsharded
    model's. The stream compared is the final norm's input, or with --sp (where that is each rank's own tokens)
    the logits, gathered whole."""
    import torch.distributed as dist

    family = case.removesuffix("_sp")
    reference, model = _models(family, plan, generated, mesh)
    full = {name: param.shape for name, param in reference.named_parameters()}
    streams: list[float] = []
    if case.endswith("_sp"):
        watched = model.get_output_embeddings().register_forward_hook(lambda m, a, out: streams.append(_spread(out)))
    else:
        watched = _final_norm(model).register_forward_pre_hook(lambda m, a: streams.append(_spread(a[0])))
    batches = _batches(reference.config.vocab_size)
    losses = _train(model, batches)
    watched.remove()
    replicated = {
        name: _spread(param) for name, param in model.named_parameters() if param.shape == full[name]
    }
    seeds = REFERENCE_SEEDS[dist.get_rank() :: dist.get_world_size()]
    reference_losses = []
    for seed in seeds:
        torch.manual_seed(seed)
        reference_losses.append(_train(copy.deepcopy(reference), batches))
    return dict(
        stream=max(streams),
        replicated=replicated,
        losses=losses,
        reference_losses=reference_losses,
    )


def _bias_inside_dropout(plan: dict, generated: str, mesh: Any) -> dict[str, Any]:
    """GPT-2 attention: where resid_dropout zeroes the partial output, the reduced output is zero."""
    _, model = _models("gpt2", plan, generated, mesh)
    attention = model.transformer.h[0].attn
    seen: dict[str, torch.Tensor] = {}
    attention.resid_dropout.register_forward_hook(
        lambda m, args, out: seen.update(dropped=(out == 0) & (args[0] != 0))
    )
    attention.register_forward_hook(lambda m, args, out: seen.update(output=out[0].detach()))
    model.train()
    model(input_ids=_batches(model.config.vocab_size)[0])
    dropped = seen["dropped"]
    return dict(dropped=int(dropped.sum()), nonzero=int((seen["output"][dropped] != 0).sum()))


def _sharded_heads_draw_apart(plan: dict, generated: str, mesh: Any) -> float:
    """GPT-2 eager attention: this rank's dropout mask on its own heads vs the other rank's."""
    import torch.nn.functional as F

    _, model = _models("gpt2", plan, generated, mesh)
    model.set_attn_implementation("eager")
    masks: list[torch.Tensor] = []
    dropout = F.dropout

    def recorded(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        output = dropout(input, *args, **kwargs)
        if input.dim() == 4:  # [batch, local heads, query, key]: the attention probabilities
            masks.append((output == 0).float())
        return output

    model.train()
    F.dropout = recorded
    try:
        model(input_ids=_batches(model.config.vocab_size)[0])
    finally:
        F.dropout = dropout
    return _spread(masks[0])


def _checkpointing(family: str, plan: dict, generated: str, mesh: Any) -> dict[str, Any]:
    """The largest gradient difference between a step with and without gradient checkpointing, and the widths
    (last dimension) of the all-reduces each step's backward ran, and the norms the checkpointed backward ran."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from hpgen.runtime import reseed_random_streams

    _, model = _models(family, plan, generated, mesh)
    ids = _batches(model.config.vocab_size)[0]
    model.train()
    grads, widths = [], []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        reseed_random_streams(model, 99)
        loss = model(input_ids=ids, labels=ids).loss
        seen: list[int] = []
        all_reduce = dist.all_reduce
        dist.all_reduce = lambda tensor, *a, **k: seen.append(tensor.shape[-1]) or all_reduce(tensor, *a, **k)
        layer_norm, norms = F.layer_norm, [0]
        F.layer_norm = lambda *a, **k: norms.__setitem__(0, norms[0] + 1) or layer_norm(*a, **k)
        try:
            loss.backward()
        finally:
            dist.all_reduce, F.layer_norm = all_reduce, layer_norm
        widths.append(sorted(seen))
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys()
    diff = max((grads[0][name] - grads[1][name]).abs().max().item() for name in grads[0])
    return {"grad_diff": diff, "widths": widths, "hidden": model.config.hidden_size, "recomputed_norms": norms[0]}


def _autocast_and_bf16(plan: dict, generated: str, mesh: Any) -> dict[str, float]:
    _, model = _models("opt", plan, generated, mesh)
    ids = _batches(model.config.vocab_size)[0]
    model.train()
    spreads: dict[str, float] = {}
    norm = _final_norm(model)
    for label in ("autocast", "bf16"):
        if label == "bf16":
            model.to(torch.bfloat16)
        hook = norm.register_forward_pre_hook(lambda m, a: spreads.update({label: _spread(a[0])}))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=label == "autocast"):
            model(input_ids=ids, labels=ids).loss.backward()
        hook.remove()
    return spreads


def _generation(plan: dict, generated: str, mesh: Any) -> dict[str, Any]:
    reference, model = _models("gpt2", plan, generated, mesh)
    reference.eval()
    model.eval()
    prompt = _batches(model.config.vocab_size)[0][:1, :5]
    options = {
        "sample": dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.8, repetition_penalty=1.2),
        "beam_sample": dict(do_sample=True, num_beams=3, top_k=20),
        "beam": dict(do_sample=False, num_beams=3),
    }
    report: dict[str, Any] = {}
    with torch.no_grad():
        for name, option in options.items():
            mine = torch.get_rng_state()
            tokens = model.generate(prompt, max_new_tokens=12, pad_token_id=0, **option)
            report[name] = tokens[0].tolist()
            report[f"{name}_own_rng_kept"] = torch.equal(torch.get_rng_state(), mine)
        torch.manual_seed(5)  # one seed everywhere: the unsharded model's tokens
        report["one_seed"] = model.generate(prompt, max_new_tokens=12, pad_token_id=0, **options["sample"])[0].tolist()
        torch.manual_seed(5)
        report["one_seed_reference"] = reference.generate(
            prompt, max_new_tokens=12, pad_token_id=0, **options["sample"]
        )[0].tolist()
    return report


def _different_inputs(plan: dict, generated: str, mesh: Any) -> str:
    """Each rank fed its own batch (a DistributedSampler over the world): the first forward stops."""
    import torch.distributed as dist

    _, model = _models("gpt2", plan, generated, mesh)
    ids = _batches(model.config.vocab_size)[dist.get_rank()]
    try:
        model(input_ids=ids)
    except RuntimeError as error:
        return str(error)
    return "no error"


def _rank(rank: int, world_size: int, files: dict[str, tuple[dict, str]]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    report: dict[str, Any] = {case: _family_report(case, *files[case], mesh) for case in TRAINED}
    report["bias"] = _bias_inside_dropout(*files["gpt2"], mesh)
    report["heads"] = _sharded_heads_draw_apart(*files["gpt2"], mesh)
    report["checkpointing"] = {
        "gpt2": _checkpointing("gpt2", *files["gpt2"], mesh),
        "llama_sp": _checkpointing("llama", *files["llama_sp"], mesh),
        # two norms moved as one pair (the summed block): the recomputed forward pairs them again
        "gpt_neox": _checkpointing("gpt_neox", *files["gpt_neox"], mesh),
    }
    report["precision"] = _autocast_and_bf16(*files["opt"], mesh)
    report["generate"] = _generation(*files["gpt2"], mesh)
    report["inputs"] = _different_inputs(*files["gpt2"], mesh)
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("training")
    files = {family: _lowered(family, directory) for family in FAMILIES}
    files["llama_sp"] = _lowered("llama", directory, sp=True)
    files.update({f"{family}_sp": _lowered(family, directory, sp=True) for family in SP_TRAINED})
    return run_distributed(_rank, files, timeout=300)


@pytest.mark.parametrize("family", TRAINED)
def test_the_replicated_stream_and_parameters_stay_equal_across_ranks(report: list[dict], family: str) -> None:
    for by_rank in report:
        assert by_rank[family]["stream"] == 0.0
        differ = {name: spread for name, spread in by_rank[family]["replicated"].items() if spread != 0.0}
        assert not differ, differ
        assert len(by_rank[family]["replicated"]) >= 5
    assert report[0][family]["losses"] == report[1][family]["losses"]


@pytest.mark.parametrize("family", TRAINED)
def test_the_loss_lies_within_the_spread_of_unsharded_seeds(report: list[dict], family: str) -> None:
    # Exactness is impossible with dropout on: the unsharded model, trained from the same weights on the same
    # batches from 4 seeds (4 sets of masks), gives at each step a mean and a spread (stdev over the seeds).
    # Over the last 10 of 20 steps, the parallel model's mean distance to the seeds' mean must stay within
    # 3 times the seeds' mean spread (one step's spread: a bound the mean of 10 correlated steps stays under).
    ours = report[0][family]["losses"]
    runs = [run for by_rank in report for run in by_rank[family]["reference_losses"]]
    assert len(runs) == len(REFERENCE_SEEDS)
    tail = range(STEPS // 2, STEPS)
    means = [statistics.fmean(run[step] for run in runs) for step in tail]
    spread = statistics.fmean(statistics.stdev(run[step] for run in runs) for step in tail)
    distance = abs(statistics.fmean(ours[step] - mean for step, mean in zip(tail, means)))
    assert spread > 0 and distance <= 3 * spread, (distance, spread)


def test_the_deferred_bias_is_dropped_with_the_partial_sum(report: list[dict]) -> None:
    for by_rank in report:
        assert by_rank["bias"]["dropped"] > 10
        assert by_rank["bias"]["nonzero"] == 0


def test_dropout_of_sharded_heads_draws_apart_on_each_rank(report: list[dict]) -> None:
    assert report[0]["heads"] > 0


@pytest.mark.parametrize("case", ["gpt2", "llama_sp", "gpt_neox"])
def test_gradient_checkpointing_redraws_the_same_masks(report: list[dict], case: str) -> None:
    for by_rank in report:
        assert by_rank["checkpointing"][case]["grad_diff"] <= 1e-6


def test_gradient_checkpointing_still_moves_two_norms_as_one_pair(report: list[dict]) -> None:
    """GPT-NeoX's recomputed forward pairs its norms again: its backward all-reduces both branches' partial
    gradients in one collective of twice the hidden width a layer, as without checkpointing (the fallback, each
    norm moving its own, would reduce two of the hidden width). (The recompute stops at the last op whose saved
    tensors backward needs, before the summed reduction: no forward all-reduce is run again.)"""
    layers = 2
    for by_rank in report:
        found = by_rank["checkpointing"]["gpt_neox"]
        hidden, (plain, recomputed) = found["hidden"], found["widths"]
        assert plain.count(2 * hidden) == recomputed.count(2 * hidden) == layers, found
        assert len(recomputed) == len(plain), found
        assert found["recomputed_norms"] == 2 * layers, found  # the recompute ran: both norms of every layer


def test_autocast_and_bf16_keep_the_stream_equal(report: list[dict]) -> None:
    for by_rank in report:
        assert by_rank["precision"] == {"autocast": 0.0, "bf16": 0.0}


@pytest.mark.parametrize("mode", ["sample", "beam_sample", "beam"])
def test_generate_gives_the_same_tokens_on_every_rank(report: list[dict], mode: str) -> None:
    assert report[0]["generate"][mode] == report[1]["generate"][mode]
    assert all(by_rank["generate"][f"{mode}_own_rng_kept"] for by_rank in report)


def test_generate_with_one_seed_everywhere_gives_the_unsharded_tokens(report: list[dict]) -> None:
    for by_rank in report:
        assert by_rank["generate"]["one_seed"] == by_rank["generate"]["one_seed_reference"]


def test_ranks_fed_different_inputs_stop_with_one_error(report: list[dict]) -> None:
    messages = [by_rank["inputs"] for by_rank in report]
    assert messages[0] == messages[1]
    assert "the ranks of axis 'tp' (global ranks 0, 1) were given different inputs" in messages[0]
    assert "rank 1 vs rank 0: input_ids differ" in messages[0]
    assert "check_inputs=False" in messages[0]
