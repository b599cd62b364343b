"""The rank side of the split-cache decoding tests (``tests/runtime/context/test_split_cache.py``).

Each case builds the unsharded transformers model and the generated one with the same
weights, parallelizes the generated one on its mesh (``cp``, or ``cp x tp``) and decodes
with both from a 64-token batch whose second row is left-padded: the logits of a cached
forward and of a 3-token forward continuing its cache, greedy tokens after 16 new ones
(``generate`` and ``return_dict_in_generate``), a decode loop of one's own, beam search, a
``StaticCache``, ``keep_whole_cache`` and eager attention (which keep every position on every
rank), sampled
tokens under one seed,
and the positions each rank's cache holds. The numbers come back to the
parent, which asserts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hpgen.runtime.context.cache import keep_whole_cache
from tests.support.models import make_config, parallelized_pair, tolerance

PROMPT = 64
NEW = 16
PAD = 5  # left padding of the second row


@dataclass(frozen=True)
class DecodeCase:
    """One model on one mesh."""

    name: str
    family: str
    generated: str  # path of the file lowered under ``plan``
    plan: dict[str, Any]
    mesh: tuple[tuple[str, int], ...]  # (axis, size) in mesh order


@dataclass
class DecodeResult:
    checks: dict[str, tuple[float, float]] = field(default_factory=dict)  # what -> (largest error, tolerance)
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)  # what -> this model's tokens
    reference: dict[str, list[list[int]]] = field(default_factory=dict)  # what -> the unsharded model's
    positions: dict[str, list[list[int]]] = field(default_factory=dict)  # when -> each layer's held positions
    lengths: dict[str, list[int]] = field(default_factory=dict)  # when -> each layer's reported length
    layer_types: list[str] = field(default_factory=list)  # the cache's layers after a prefill, and after one with grad
    cp_rank: int = 0
    whole_cache_lengths: list[int] = field(default_factory=list)  # keys held per layer under keep_whole_cache
    eager_cache_lengths: list[int] = field(default_factory=list)  # keys held per layer after eager generation


def _cache(output: Any) -> Any:
    return output.cache


def _held(cache: Any) -> tuple[list[list[int]], list[int], list[str]]:
    positions, lengths, types = [], [], []
    for layer in cache.layers:
        held = getattr(layer, "positions", None)
        keys = layer.keys
        if held is not None:
            assert keys.size(-2) == held.numel(), "keys and positions disagree"
        positions.append([] if held is None else held.tolist())
        lengths.append(layer.get_seq_length())
        types.append(type(layer).__name__)
    return positions, lengths, types


def _compare(result: DecodeResult, what: str, want: torch.Tensor, got: torch.Tensor) -> None:
    result.checks[what] = ((want - got).abs().max().item(), tolerance(want))


def run_decode_cases(rank: int, world_size: int, cases: list[DecodeCase]) -> dict[str, DecodeResult]:
    results = {}
    for case in cases:
        config = make_config(case.family)
        mesh, ref, model = parallelized_pair(case.family, case.generated, case.plan, case.mesh, config)
        result = DecodeResult(cp_rank=mesh["cp"].get_local_rank())
        generator = torch.Generator().manual_seed(5)
        ids = torch.randint(1, config.vocab_size, (2, PROMPT), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, :PAD] = 0
        ids[1, :PAD] = 0
        more = torch.randint(1, config.vocab_size, (2, 3), generator=generator)
        longer = torch.cat([mask, torch.ones_like(more)], dim=1)
        with torch.no_grad():
            want = ref(ids, attention_mask=mask, use_cache=True)
            got = model(ids, attention_mask=mask, use_cache=True)
            _compare(result, "prefill logits", want.logits, got.logits)
            result.positions["prefill"], result.lengths["prefill"], result.layer_types = _held(_cache(got))
            want_next = ref(more, attention_mask=longer, cache=_cache(want))
            got_next = model(more, attention_mask=longer, cache=_cache(got))
            _compare(result, "cached forward logits", want_next.logits, got_next.logits)
            result.positions["continued"], result.lengths["continued"], _ = _held(_cache(got_next))

            greedy = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            result.reference["greedy"] = ref.generate(ids, **greedy)[:, PROMPT:].tolist()
            result.tokens["greedy"] = model.generate(ids, **greedy)[:, PROMPT:].tolist()
            out = model.generate(ids, **greedy, return_dict_in_generate=True, output_scores=True)
            result.tokens["return_dict_in_generate"] = out.sequences[:, PROMPT:].tolist()
            result.positions["generated"], result.lengths["generated"], _ = _held(_cache(out))
            ref_out = ref.generate(ids, **greedy, return_dict_in_generate=True, output_scores=True)
            _compare(result, "generate scores", torch.stack(ref_out.scores), torch.stack(out.scores))

            result.reference["own loop"], _ = _own_loop(ref, ids, mask)
            result.tokens["own loop"], types = _own_loop(model, ids, mask)
            result.layer_types += types

            beams = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
            result.reference["beam search"] = ref.generate(ids, **beams)[:, PROMPT:].tolist()
            result.tokens["beam search"] = model.generate(ids, **beams)[:, PROMPT:].tolist()  # reorders the split cache
            static = dict(greedy, max_new_tokens=6, cache_implementation="static")  # a cache that keeps the whole
            result.reference["static cache"] = ref.generate(ids, **static)[:, PROMPT:].tolist()
            result.tokens["static cache"] = model.generate(ids, **static)[:, PROMPT:].tolist()

            keep_whole_cache(model)  # every position on every rank, decode steps replicated: as before the split
            whole = model.generate(ids, **greedy, return_dict_in_generate=True)
            result.tokens["whole cache"] = whole.sequences[:, PROMPT:].tolist()
            result.reference["whole cache"] = result.reference["greedy"]
            result.whole_cache_lengths = [layer.keys.size(-2) for layer in whole.cache.layers]
            keep_whole_cache(model, False)

            # eager attention: the split cache's decode attention is cp's sdpa, so under eager the cache keeps
            # every position on every rank and decode steps run replicated
            for either in (ref, model):
                either.set_attn_implementation("eager")
            eager = model.generate(ids, **greedy, return_dict_in_generate=True)
            result.tokens["eager"] = eager.sequences[:, PROMPT:].tolist()
            result.reference["eager"] = ref.generate(ids, **greedy)[:, PROMPT:].tolist()
            result.eager_cache_lengths = [layer.keys.size(-2) for layer in eager.cache.layers]
            for either in (ref, model):
                either.set_attn_implementation("sdpa")

            sampled = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=0, pad_token_id=0)
            torch.manual_seed(17)
            result.reference["sampled"] = ref.generate(ids, **sampled)[:, PROMPT:].tolist()
            torch.manual_seed(17)
            result.tokens["sampled"] = model.generate(ids, **sampled)[:, PROMPT:].tolist()
        results[case.name] = result
    return results


def _own_loop(model: Any, ids: torch.Tensor, mask: torch.Tensor, steps: int = 5) -> tuple[list[list[int]], list[str]]:
    """Greedy decoding written by hand: the cache and the mask carried from step to step; the
    prefill with gradients enabled (a cp model's training-step attention fills the cache)."""
    with torch.enable_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
    types = [type(layer).__name__ for layer in out.cache.layers]
    tokens = []
    for _ in range(steps):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(token, attention_mask=mask, cache=out.cache, use_cache=True)
    return torch.cat(tokens, dim=1).tolist(), types
