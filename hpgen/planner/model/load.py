"""Loading: the config, the model on the meta device, and the modeling file its class comes from.

A model type (``llama``) or a config.json becomes a config (:func:`load_config`), the
config the causal-LM class it builds (:func:`model_class_for`, :func:`model_and_config`),
and that class an instance on the meta device (:func:`meta_model`): every module and
shape, no weights, nothing downloaded. The later steps read the class's modeling file
(:func:`source_file`, :func:`index_source`) to find each boundary's ``forward``.

torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpgen.core.errors import HpgenError, did_you_mean

if TYPE_CHECKING:
    from torch import nn

    from hpgen.generator.index_records import ModuleIndex, ParsedSource

__all__ = [
    "defined_in",
    "index_source",
    "load_config",
    "meta_model",
    "model_and_config",
    "model_class_for",
    "one_line",
    "source_file",
]


def load_config(target: str) -> Any:
    """The config of a model type (``AutoConfig.for_model``) or of a config.json file or folder."""
    from transformers import AutoConfig

    path = Path(target)
    if target.endswith(".json") or "/" in target or "\\" in target or (path / "config.json").is_file():
        if not path.exists():
            raise HpgenError("no such config file", file=target)
        try:
            return AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HpgenError(f"cannot load the config: {one_line(exc)}", file=target) from None
    try:
        return AutoConfig.for_model(target)
    except ValueError:
        from transformers import CONFIG_MAPPING

        close = did_you_mean(target, CONFIG_MAPPING.keys())
        raise HpgenError(
            f"{target!r} is neither a config.json path nor a model type of the installed transformers"
            + (close or " (e.g. llama, qwen3_moe)")
        ) from None
    except (TypeError, KeyError, AttributeError) as exc:
        raise HpgenError(f"{target}: transformers cannot build its default config: {one_line(exc)}") from None


def model_class_for(config: Any) -> type:
    """The class to instantiate: the causal LM if there is one, else the base model.

    Configs of sub-models (``qwen2_5_vl_text``) that no auto class maps are looked up in
    their own modeling module: the ``PreTrainedModel`` subclass built from exactly this
    config class, a ``*ForCausalLM`` first.
    """
    import importlib

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    config_class = type(config)
    for architecture in getattr(config, "architectures", None) or ():
        found = getattr(transformers, architecture, None)
        if isinstance(found, type) and getattr(found, "config_class", None) is config_class:
            return found
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING):
        if config_class in mapping:
            try:
                return mapping[config_class]
            except ValueError:  # mapped to a class this transformers does not define; search below
                break
    package = config_class.__module__.rpartition(".")[0]
    try:
        modeling = importlib.import_module(f"{package}.modeling_{package.rpartition('.')[2]}")
    except ImportError:
        modeling = None
    candidates: list[type] = []
    for value in vars(modeling).values() if modeling is not None else ():
        if isinstance(value, type) and getattr(value, "config_class", None) is config_class and value not in candidates:
            candidates.append(value)
    # a deprecated alias is a subclass of the class it renames: keep the original (every model subclasses
    # the PreTrainedModel, which is no alias)
    candidates = [cls for cls in candidates if not cls.__name__.endswith("PreTrainedModel")]
    candidates = [
        cls for cls in candidates if not any(other is not cls and issubclass(cls, other) for other in candidates)
    ]
    causal = [cls for cls in candidates if cls.__name__.endswith("ForCausalLM")]
    models = [cls for cls in candidates if not cls.__name__.endswith("PreTrainedModel")]
    for group in (causal, models, [cls for cls in models if cls.__name__.endswith("Model")]):
        if len(group) == 1:
            return group[0]
    raise HpgenError(f"{config_class.__name__}: no model class of the installed transformers is built from this config")


def model_and_config(config: Any) -> tuple[type, Any]:
    """The model class of ``config`` and the config to build it from.

    A multimodal config whose causal LM is built from its text part (``llama4`` ->
    ``Llama4ForCausalLM(Llama4TextConfig)``) hands over that text config.
    """
    cls = model_class_for(config)
    wanted = getattr(cls, "config_class", None)
    if wanted is not None and not isinstance(config, wanted) and hasattr(config, "get_text_config"):
        try:
            text = config.get_text_config()
        except ValueError:  # several text configs (musicgen: text_encoder and decoder): the one of the class
            text = next((v for v in vars(config).values() if isinstance(v, wanted)), None)
        if isinstance(text, wanted):
            return cls, text
    return cls, config


def meta_model(config: Any) -> nn.Module:
    """The model of ``config`` on the meta device: every module and shape, no memory, no weights."""
    import torch

    cls, config = model_and_config(config)
    try:
        with torch.device("meta"):
            return cls._from_config(config)
    except Exception as exc:  # a config transformers cannot build a model from: bad input, said in one line
        raise HpgenError(f"{cls.__name__}: cannot build the model from its config: {one_line(exc)}") from None


def source_file(cls: type) -> str:
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        path = None
    if path is None:
        raise HpgenError(f"{cls.__name__}: cannot find the file that defines it")
    return path


def defined_in(cls: type, source: Path) -> bool:
    """True when ``cls`` is defined in the file ``source``."""
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return False
    return path is not None and Path(path).resolve() == source.resolve()


def index_source(source: Path) -> tuple[ParsedSource, ModuleIndex]:
    """``source`` parsed and indexed; read-only for the callers: the same text is parsed once a process
    (each plan reads its modeling file again, and parsing is most of a small model's planning)."""
    return _indexed(source.name, source.read_text(encoding="utf-8"))


@lru_cache(maxsize=16)
def _indexed(name: str, text: str) -> tuple[ParsedSource, ModuleIndex]:
    from hpgen.generator.index import index_module, parse_source

    parsed = parse_source(text, name=name)
    return parsed, index_module(parsed)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
