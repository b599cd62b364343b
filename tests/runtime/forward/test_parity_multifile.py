"""2-rank parity of plans that reach past one modeling file or correct transformers' plan.

GOT-OCR2's language model is Qwen2's, built through ``AutoModel``: its plan names two modeling
files, each is lowered on its own, and ``parallelize(..., generated=[...])`` gives the Qwen2
modules the generated classes of the lowered ``modeling_qwen2.py``. Inkling2's plan shards its
experts' packed ``gate_up_proj`` with plain ``colwise``; the translator reads the ``chunk(2)`` in
the source and writes ``SS(1,2)``. LongCat-Flash's identity experts (``moe_identity_expert``) sit in
the experts' sum, which is all-reduced: their output goes ``R -> P(sum)``, divided by the axis
size. All run the coverage harness's own comparison
(``benchmarks/coverage.py``): transformers' unsharded model against the generated one on 2 gloo
ranks, logits and every gradient.
"""

from __future__ import annotations

from pathlib import Path


def test_multifile_and_corrected_plans_match_the_unsharded_model(tmp_path: Path) -> None:
    # by its package path, sys.path untouched: a top-level ``coverage`` would shadow coverage.py (pytest-cov)
    from benchmarks import coverage

    prepared = [coverage.prepare(name, tmp_path) for name in ("got_ocr2", "inkling2_text", "longcat_flash")]
    for row, case in prepared:
        assert case is not None, row.reason
    got_ocr2 = prepared[0][1]
    assert len(got_ocr2.others) == 1 and got_ocr2.others[0].endswith("modeling_qwen2.py")
    outcomes = coverage.compare([case for _, case in prepared], timeout=240)
    for row, case in prepared:
        coverage.finish(row, outcomes[case.model_type])
        assert row.parity and row.grads_ok, f"{row.model_type}: {row.reason}"
        assert row.layers_sharded, row.model_type
