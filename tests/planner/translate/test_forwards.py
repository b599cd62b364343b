"""Each class's ``forward`` read from its modeling file (:mod:`hpgen.planner.translate.forwards`)."""

from __future__ import annotations




def test_output_names_come_from_records_not_from_a_tensor_method_with_keywords() -> None:
    # Inkling2's short convolution ends ``return hidden_states.to(dtype=input_dtype)``: one tensor, named
    # ``output``; a ``dtype`` output would make the generated forward assign ``outputs.dtype``
    from hpgen.generator.index import parse_source
    from hpgen.planner.translate.forwards import return_names

    source = (
        "class Conv:\n    def forward(self, x):\n        return x.to(dtype=x.dtype)\n\n"
        "class Model:\n    def forward(self, x):\n        return BaseModelOutput(last_hidden_state=x)\n"
    )
    parsed = parse_source(source)
    assert return_names(parsed, "Conv") == ("output",)
    assert return_names(parsed, "Model") == ("last_hidden_state",)
