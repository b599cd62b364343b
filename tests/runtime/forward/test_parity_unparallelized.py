"""Without ``parallelize`` a generated file computes exactly what the original does.

The class-level defaults of generated files (``_hp_<axis>`` = identity, ``tp_enable``
False, ``__hp_compute__`` = ``_forward_impl``) must make every rewritten ``forward``
the original one: same logits bit for bit, in one process, no process group.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.models import generated_model, import_file, lower_family, make_config, reference_model

CASES = [
    ("llama", "llama_tp", "default"),
    ("llama", "llama_tp_sp", "default"),  # a boundary RMSNorm, a decoder layer with a split
    ("llama", "llama_tp_vocab", "toggle"),
    ("llama", "llama_generic", "default"),  # the generic form's identity boundary
    ("qwen2", "qwen2_tp", "default"),
    ("qwen3", "qwen3_tp", "default"),
    ("qwen3_moe", "qwen3_moe_tp_ep", "default"),  # the region form's default compute
]


@pytest.mark.parametrize(("family", "plan", "mode"), CASES)
def test_generated_file_is_bit_identical_without_parallelize(tmp_path, family: str, plan: str, mode: str) -> None:
    torch.set_num_threads(1)
    config = make_config(family, attention_bias=True) if family == "llama" else make_config(family)
    reference = reference_model(family, config, seed=3)
    model = generated_model(import_file(lower_family(family, plan, tmp_path, mode=mode)), family, config, reference)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
