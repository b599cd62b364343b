"""The libcst indexer: classes, forward signatures, returns, imports, positions."""

import textwrap

import pytest

from hpgen.core.errors import HpgenError
from hpgen.generator.index import index_module, parse_source


def index(source: str):
    source = textwrap.dedent(source)
    return index_module(parse_source(source))


def test_forward_parameters_of_every_kind_and_decorators():
    found = index(
        '''
        class A(nn.Module):
            @deco("x", 1)
            @other
            def forward(self, a, /, b, c=1, *args, d, e=2, **kwargs) -> int:
                """Doc."""
                return a
        '''
    ).classes["A"]
    forward = found.forward
    assert [(p.name, p.kind, p.has_default) for p in forward.parameters] == [
        ("self", "positional_only", False),
        ("a", "positional_only", False),
        ("b", "positional", False),
        ("c", "positional", True),
        ("args", "var_positional", False),
        ("d", "keyword_only", False),
        ("e", "keyword_only", True),
        ("kwargs", "var_keyword", False),
    ]
    assert forward.decorators == ('deco("x", 1)', "other")
    assert forward.docstring == "Doc."
    assert forward.line == 5 and found.line == 2
    assert forward.has_var_positional and forward.has_var_keyword


def test_return_shapes_ignore_nested_functions():
    forward = index(
        """
        class A:
            def forward(self, x):
                def helper():
                    return None
                class Inner:
                    def f(self):
                        return 1, 2, 3
                fn = lambda: 5
                if x:
                    return x, None
                return (x, helper())
        """
    ).classes["A"].forward
    assert [(r.kind, r.length, r.line) for r in forward.returns] == [("tuple", 2, 11), ("tuple", 2, 12)]
    assert not forward.falls_off_end


def test_return_kinds():
    forward = index(
        """
        class A:
            def forward(self, x):
                if x is None:
                    return
                if x:
                    return Out(last_hidden_state=x, cache=None)
                if x > 1:
                    return (*x,)
                if x > 2:
                    return outputs.CausalLMOutput(logits=x)
                if x > 3:
                    return x.to(dtype=torch.float32)  # a tensor method with keywords only: not a record
                return x
        """
    ).classes["A"].forward
    kinds = [(r.kind, r.length, r.keywords) for r in forward.returns]
    assert kinds == [
        ("none", None, ()),
        ("record", None, ("last_hidden_state", "cache")),
        ("tuple", None, ()),
        ("record", None, ("logits",)),
        ("value", None, ()),
        ("value", None, ()),
    ]


def test_falls_off_end_and_one_line_forward():
    found = index(
        """
        class A:
            def forward(self, x): return x
        class B:
            def forward(self, x):
                print(x)
        """
    )
    assert found.classes["A"].forward.one_line and not found.classes["A"].forward.falls_off_end
    assert found.classes["B"].forward.falls_off_end


def test_children_from_init():
    found = index(
        """
        class M(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.embed = nn.Embedding(3, 4)
                self.layers = nn.ModuleList([Layer(config, i) for i in range(3)])
                self.pair = nn.ModuleList([Layer(config, 0), Layer(config, 1)])
                self.norm: Norm = Norm(4)
                self.act = get_act("silu")
                self.size = config.hidden
                other.x = Nope()
                if config.moe:
                    self.mlp = Moe(config)
                else:
                    self.mlp = Mlp(config)
        """
    ).classes["M"]
    children = {attr: [(c.class_name, c.is_list, c.line) for c in kids] for attr, kids in found.children.items()}
    assert children == {
        "embed": [("nn.Embedding", False, 5)],
        "layers": [("Layer", True, 6)],
        "pair": [("Layer", True, 7)],
        "norm": [("Norm", False, 8)],
        "mlp": [("Moe", False, 13), ("Mlp", False, 15)],
    }


def test_import_block_end_includes_multiline_imports():
    found = index(
        '''
        """Doc."""
        from __future__ import annotations
        import torch
        from .utils import (
            a,
            b,
        )
        logger = get_logger()
        class A: pass
        from late import thing
        '''
    )
    assert found.last_import_index == 3
    assert found.docstring == "Doc."


def test_relative_imports_are_found_everywhere_with_lines():
    found = index(
        """
        from ..utils import a
        from . import b
        def f():
            from ...deep.mod import c
        """
    )
    assert [(r.line, r.level, r.module) for r in found.relative_imports] == [(2, 2, "utils"), (3, 1, None), (5, 3, "deep.mod")]


def test_forward_defined_twice_and_not_a_def():
    found = index(
        """
        class A:
            def forward(self, x):
                return x
            def forward(self, x):
                return x
        class B:
            forward = something
        """
    )
    assert found.classes["A"].forward_lines == (3, 5)
    assert not found.classes["B"].forward_is_function


def test_generated_file_is_recognized():
    assert index("# Generated by hpgen 0.1.0: do not edit.\nx = 1\n").is_generated
    assert index("import hpgen.runtime.defaults as _hp_runtime\n").is_generated
    assert not index("x = 1\n").is_generated


def test_syntax_error_names_line_and_column():
    with pytest.raises(HpgenError) as caught:
        parse_source("class A:\n    def forward(self:\n        pass\n", name="m.py")
    assert str(caught.value) == "m.py:2:16: source does not parse: '(' was never closed"
