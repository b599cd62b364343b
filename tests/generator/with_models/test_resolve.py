"""Static FQN -> class resolution from __init__ assignments."""

import textwrap

import pytest

from hpgen.core.errors import HpgenError
from hpgen.generator.index import index_module, parse_source
from hpgen.core.plan import plan_from_dict
from hpgen.generator.resolve import resolve_boundaries

from tests.conftest import transformers_modeling_file

OUT = {"out_src": {"o": {"tp": "P(sum)"}}}


def resolve(source: str, keys, **top):
    plan = plan_from_dict({"mesh_dim_names": ["tp"], "param_plan": {key: OUT for key in keys}, **top}, name="p.json")
    return resolve_boundaries(plan, index_module(parse_source(textwrap.dedent(source))), source_name="m.py")


MODEL = """
class Mlp(nn.Module):
    def __init__(self):
        self.up = nn.Linear(1, 2)
class Base(nn.Module):
    def __init__(self):
        self.mlp = Mlp()
class Layer(Base):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
class Attn(nn.Module):
    pass
class Inner(PreTrainedModel):
    def __init__(self):
        self.layers = nn.ModuleList([Layer() for _ in range(2)])
        self.embed = nn.Embedding(3, 4)
class TopForCausalLM(PreTrainedModel):
    def __init__(self):
        self.model = Inner()
        self.lm_head = nn.Linear(1, 2)
"""


def test_walks_attributes_lists_and_base_classes():
    found = resolve(MODEL, ["model.layers.*.attn", "model.layers.0.mlp", "model.embed", "lm_head", "model.layers.1.mlp.up"])
    assert {key: (r.name, r.external) for key, r in found.items()} == {
        "model.layers.*.attn": ("Attn", False),
        "model.layers.0.mlp": ("Mlp", False),
        "model.embed": ("nn.Embedding", True),
        "lm_head": ("nn.Linear", True),
        "model.layers.1.mlp.up": ("nn.Linear", True),
    }


def test_model_class_and_boundary_classes_win():
    found = resolve(MODEL, ["layers.*.attn", "x.y"], model_class="Inner", boundary_classes={"x.y": "Attn"})
    assert found["layers.*.attn"].name == "Attn"
    assert found["x.y"].name == "Attn"


def test_root_is_the_top_level_pretrained_model_without_a_causal_lm():
    source = MODEL.replace("TopForCausalLM", "Top")
    assert resolve(source, ["model.layers.*.attn"])["model.layers.*.attn"].name == "Attn"


@pytest.mark.parametrize(
    ("keys", "top", "message"),
    [
        (["model.nothing"], {}, "Inner.__init__ assigns no submodule 'nothing'; add it to boundary_classes"),
        (["model.layers.attn"], {}, "model.layers is an nn.ModuleList: expected an index or '*', got 'attn'"),
        (["model.layers"], {}, "is an nn.ModuleList, not one module"),
        (["model.*"], {}, "Inner is not an nn.ModuleList"),
        (["lm_head.weight"], {}, "nn.Linear is not defined in m.py"),
        (["a"], {"model_class": "Missing"}, "model_class: class 'Missing' is not defined in m.py"),
        (["a"], {"boundary_classes": {"a": "Missing"}}, "class 'Missing' is not defined in m.py"),
    ],
)
def test_unresolvable_names_the_key(keys, top, message):
    with pytest.raises(HpgenError) as caught:
        resolve(MODEL, keys, **top)
    assert str(caught.value).startswith("p.json:")
    assert message in str(caught.value)


def test_two_classes_for_one_attribute_is_an_error_naming_both():
    source = transformers_modeling_file("qwen3_moe").read_text()
    with pytest.raises(HpgenError) as caught:
        resolve(source, ["model.layers.*.mlp"])
    message = str(caught.value)
    assert "Qwen3MoeDecoderLayer.mlp is assigned more than one class" in message
    assert "Qwen3MoeSparseMoeBlock" in message and "Qwen3MoeMLP" in message
    assert "add it to boundary_classes" in message


def test_resolves_the_installed_llama():
    found = resolve(
        transformers_modeling_file("llama").read_text(),
        ["model.layers.*.self_attn", "model.layers.*.mlp", "model.embed_tokens", "lm_head", "model.norm"],
    )
    assert {key: r.name for key, r in found.items()} == {
        "model.layers.*.self_attn": "LlamaAttention",
        "model.layers.*.mlp": "LlamaMLP",
        "model.embed_tokens": "nn.Embedding",
        "lm_head": "nn.Linear",
        "model.norm": "LlamaRMSNorm",
    }


def test_qualified_names_split_a_plan_between_its_modeling_files():
    # a plan whose boundaries live in two files: this file (m.py) takes its own keys by qualified
    # name and leaves the other file's to that file's lowering; torch's classes stay external
    found = resolve(
        MODEL,
        ["model.layers.*.attn", "other.attn", "lm_head"],
        boundary_classes={
            "model.layers.*.attn": "pkg.m.Attn",
            "other.attn": "transformers.models.qwen2.modeling_qwen2.Qwen2Attention",
            "lm_head": "nn.Linear",
        },
    )
    assert found["model.layers.*.attn"].name == "Attn" and not found["model.layers.*.attn"].external
    assert found["other.attn"].elsewhere and found["other.attn"].external
    assert found["lm_head"].external and not found["lm_head"].elsewhere
    # any outside class takes any contract: the runtime's generic wrapper runs its own forward
    outside = resolve(MODEL, ["a", "b"], boundary_classes={"a": "torch.nn.LayerNorm", "b": "nn.Conv2d"})
    assert all(found.external and not found.elsewhere for found in outside.values())
    with pytest.raises(HpgenError, match="class 'Missing' is not defined in m.py"):
        resolve(MODEL, ["a"], boundary_classes={"a": "pkg.m.Missing"})
