"""Styles of transformers' plan the source contradicts, corrected (:mod:`hpgen.planner.translate.corrections`)."""

from __future__ import annotations

from tests.planner.plan_helpers import entry, translated


def test_a_packed_gate_up_split_by_chunk_is_corrected_to_packed_colwise() -> None:
    # transformers' inkling plan says colwise for experts.gate_up_proj, which forward splits with
    # chunk(2) (inkling2 through self._apply_gate): each rank needs its chunk of both blocks
    for model_type in ("inkling_text", "inkling2_text"):
        _, plan = translated(model_type)
        experts = entry(plan, "model.layers.*.mlp.experts")
        assert experts["params"]["gate_up_proj"] == {"tp": "SS(1,2)"}, model_type
        assert "chunk(2)" in plan["comments"]["corrected"]["model.layers.*.mlp.experts.gate_up_proj"]
    # the shared experts' gating weights, a second input of a sharded MLP-like block, get R -> R too
    _, inkling = translated("inkling_text")
    assert entry(inkling, "model.layers.*.mlp.shared_experts")["in_src"] == {
        "hidden_states": {"tp": "R"},
        "gammas": {"tp": "R"},
    }
    _, qwen3_moe = translated("qwen3_moe")  # packed_colwise already: nothing to correct
    assert "corrected" not in qwen3_moe["comments"]


def test_chunked_attributes_reads_forward_and_the_methods_it_calls() -> None:
    import ast
    import textwrap

    from hpgen.planner.translate.corrections import chunked_attributes

    source = textwrap.dedent(
        """
        class E:
            def forward(self, x):
                a, b = linear(x, self.w[0]).chunk(2, dim=-1)
                y = self._gate(linear(x, self.v))
                z = self.u(x).chunk(3, dim=-1)
                return self.d(a * b + y)
            def _gate(self, h):
                g, u = h.chunk(2, dim=-1)
                return g * u
        """
    )
    assert chunked_attributes(ast.parse(source), "E") == {"w", "v"}
