"""A case ready for the ranks: the plan, the tiny config, and the modeling file lowered with the plan.

:func:`prepare` reads what the user gives (a plan; a model type, config.json or checkpoint
folder, or nothing, and then the plan's ``model_class`` with transformers' default config;
optionally the modeling file), shrinks the config (:mod:`hpgen.verify.shrink`) and lowers the
source into a folder. Everything wrong with the input is an :class:`~hpgen.core.errors.HpgenError`
naming the file and the place, raised before any rank starts.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpgen.core.errors import HpgenError

__all__ = ["ATTENTION_IMPLEMENTATIONS", "Prepared", "prepare"]

# ``hpgen verify --attn-implementation``: transformers' attention paths a plan is proven on. They differ in
# what a sharded attention meets (eager repeats key/value heads by ``num_key_value_groups``, sdpa may not), so a
# plan exact under one can crash under the other; without the option the config keeps transformers' default.
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


@dataclass(frozen=True)
class Prepared:
    """One case for :func:`hpgen.verify.compare.run_cases` (picklable: it travels to the ranks)."""

    name: str
    plan: dict[str, Any]  # the decoded plan document
    plan_name: str
    config: Any  # the tiny config
    class_name: str
    reference_module: str  # the module of the unsharded class (without ``--source``)
    reference_file: str | None  # ``--source``: the unsharded class comes from this file
    reference_package: str | None
    generated: str  # the lowered file
    others: tuple[str, ...]  # lowered files of the other modeling files the boundaries live in
    mesh: tuple[tuple[str, int], ...]  # (axis, size) in mesh order
    source: str  # the modeling file that was lowered
    layers: tuple[str, ...] = ()  # numbered layers folded (:func:`fewer_layers`): what each tiny one stands for
    trust_plan_code: bool = False  # parallelize's: the plan may import any function (hpgen.core.plan_trust)
    trusted_modules: tuple[str, ...] = ()  # parallelize's: modules whose functions the plan may import

    @property
    def world_size(self) -> int:
        size = 1
        for _, count in self.mesh:
            size *= count
        return size


def prepare(
    plan: str | Path | dict[str, Any],
    directory: Path,
    *,
    model: str | None = None,
    source: str | Path | None = None,
    ranks: int | None = None,
    name: str | None = None,
    trust_plan_code: bool = False,
    trusted_modules: tuple[str, ...] = (),
    attn_implementation: str | None = None,
) -> Prepared:
    """Shrink the config, lower the source with ``plan`` into ``directory``; the case to run.

    A plan whose injections name functions the user has not trusted (``trust_plan_code``,
    ``trusted_modules``: as for ``parallelize``) is refused here, before any rank imports them.
    ``attn_implementation`` (one of :data:`ATTENTION_IMPLEMENTATIONS`) is set on the tiny config, so that both
    the unsharded and the parallelized model run that attention path (``None``: transformers' default)."""
    from hpgen.generator.generate import infer_package, read_source
    from hpgen.generator.lower import lower
    from hpgen.core.plan import load_plan, plan_from_dict
    from hpgen.core.plan_trust import untrusted_target
    from hpgen.verify.shrink import (
        axis_sizes, fold_layers, kept_heads, more_layers, scaled_units, shape_for, stages_for_layers, tiny_config,
    )

    if source is not None and not Path(source).is_file():
        raise HpgenError("no such modeling file", file=str(source))
    if attn_implementation is not None and attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise HpgenError(
            f"--attn-implementation {attn_implementation!r}: choose one of {', '.join(ATTENTION_IMPLEMENTATIONS)}"
        )
    if isinstance(plan, dict):
        document, plan_name = plan, f"{name or 'plan'}.json"
        loaded = plan_from_dict(document, name=plan_name)
    else:
        loaded = load_plan(plan)
        plan_name = str(plan)
        document = json.loads(Path(plan).read_text(encoding="utf-8"))
    try:
        untrusted = untrusted_target(loaded, trust_plan_code=trust_plan_code, trusted_modules=trusted_modules)
    except ValueError as error:
        raise HpgenError(str(error)) from None
    if untrusted is not None:
        raise HpgenError(untrusted.removeprefix(f"{plan_name}: "), file=plan_name)
    try:
        sizes = axis_sizes(loaded, ranks)
    except ValueError as error:
        raise HpgenError(str(error)) from None
    document, layers = fewer_layers(document)
    loaded = plan_from_dict(document, name=plan_name)
    config = _config(loaded, model, plan_name)
    kept, factor = kept_heads(config, loaded, sizes)  # heads that do not divide stay, head_dim shrinks instead
    shape = {**shape_for(loaded, sizes), **kept}
    try:
        document = scaled_units(document, factor)
    except ValueError as error:
        raise HpgenError(f"cannot shrink the plan's whole-head units with head_dim: {error}", file=plan_name) from None
    loaded = plan_from_dict(document, name=plan_name)
    if any(getattr(config, key, None) for key in _EXPERT_COUNTS):
        # transformers' default experts kernel (grouped_mm) needs 16-byte rows: the tiny 89 is odd
        shape = {**shape, "intermediate_size": 96}
    given = config
    try:
        config = tiny_config(config, shape)
    except HpgenError:
        raise
    except Exception as error:  # noqa: BLE001 - transformers refuses the shrunk config
        raise HpgenError(f"cannot shrink the config for the check: {type(error).__name__}: {error}") from None
    if attn_implementation is not None:  # transformers' setter passes it on to the sub-configs
        config._attn_implementation = attn_implementation
    if len(layers) > 2:  # one tiny layer per distinct contract of the numbered layers, of the kind it stands for
        fold_layers(config, given, [int(name.rpartition(".")[2].split("-")[0]) for name in layers])
    document, count = stages_for_layers(document, config.num_hidden_layers)  # the stages named on the tiny layers
    if count != config.num_hidden_layers:
        more_layers(config, count)
    loaded = plan_from_dict(document, name=plan_name)
    cls = _model_class(loaded, config, plan_name)
    if source is None:
        source_path = Path(inspect.getsourcefile(cls) or "")
        reference_file, reference_package = None, None
    else:
        source_path = Path(source)
        reference_file, reference_package = str(source_path.resolve()), infer_package(source_path)
    text, _ = read_source(source_path)
    if cls.__name__ not in text:
        raise HpgenError(f"the source does not define {cls.__name__}, the plan's model class", file=str(source_path))
    directory.mkdir(parents=True, exist_ok=True)
    tag = name or source_path.stem
    generated = directory / f"{tag}_hpgen.py"
    generated.write_text(
        lower(text, loaded, source_name=source_path.name, package=infer_package(source_path)), encoding="utf-8"
    )
    others = []
    for module_name in document.get("comments", {}).get("modeling_files", []):
        other = _module_file(module_name)
        if other is None or other.resolve() == source_path.resolve():
            continue
        written = directory / f"{tag}_{other.stem}_hpgen.py"
        other_text, _ = read_source(other)
        written.write_text(lower(other_text, loaded, source_name=other.name, package=infer_package(other)), encoding="utf-8")
        others.append(str(written))
    return Prepared(
        name=name or Path(plan_name).stem,
        plan=document,
        plan_name=plan_name,
        config=config,
        class_name=cls.__name__,
        reference_module=cls.__module__,
        reference_file=reference_file,
        reference_package=reference_package,
        generated=str(generated),
        others=tuple(others),
        mesh=tuple(sizes.items()),
        source=str(source_path),
        layers=tuple(layers),
        trust_plan_code=trust_plan_code,
        trusted_modules=tuple(trusted_modules),
    )


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def fewer_layers(document: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The plan with its numbered layers (``model.layers.7``) folded to as few as tell them apart.

    ``hpgen plan --sp`` names each decoder layer of the full config (the first enters from the
    replicated embedding); the tiny copy has a few. A run of consecutive layers whose entries
    are alike becomes one layer, so the tiny model has one layer per distinct contract, in
    order (at least two); the second list says which original layers each tiny one stands for.
    """
    entries = document.get("param_plan", {})
    numbered: dict[str, dict[int, dict[str, Any]]] = {}  # the list's path -> index -> {rest of key: entry}
    for key, entry in entries.items():
        parts = key.split(".")
        for at, part in enumerate(parts):
            if part.isdigit():
                numbered.setdefault(".".join(parts[:at]), {}).setdefault(int(part), {})[".".join(parts[at + 1 :])] = entry
                break
    if len(numbered) != 1:
        return document, []
    (path, by_index), = numbered.items()
    count = max(by_index) + 1
    runs: list[list[int]] = []
    for index in range(count):
        if runs and _same(by_index.get(index), by_index.get(runs[-1][0])):
            runs[-1].append(index)
        else:
            runs.append([index])
    if len(runs) == 1 and count > 1:  # every layer alike: still two of them
        runs = [runs[0][:1], runs[0][1:]]
    if len(runs) == count:
        return document, []
    folded = {key: entry for key, entry in entries.items() if not _under(key, path)}
    for tiny, run in enumerate(runs):
        for rest, entry in by_index.get(run[0], {}).items():
            folded[".".join(part for part in (path, str(tiny), rest) if part)] = entry
    result = {**document, "param_plan": folded}
    names = [f"{path}.{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else "") for run in runs]
    return result, names


def _same(first: Any, second: Any) -> bool:
    return json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


def _under(key: str, path: str) -> bool:
    rest = key[len(path) + 1 :] if key.startswith(path + ".") else ""
    return bool(rest) and rest.split(".")[0].isdigit()


def _config(plan: Any, model: str | None, plan_name: str) -> Any:
    """The config given (model type, config.json, checkpoint folder), else the plan's class's default."""
    from hpgen.planner.model.load import load_config

    if model is not None:
        return load_config(model)
    if plan.model_class is None:
        raise HpgenError("the plan names no model_class: give MODEL (a model type, config.json or checkpoint)", file=plan_name)
    import transformers

    cls = getattr(transformers, plan.model_class, None)
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        raise HpgenError(
            f"model_class {plan.model_class!r} is no class of the installed transformers: give MODEL (a model "
            "type, config.json or checkpoint)",
            file=plan_name,
        )
    return config_class()


def _model_class(plan: Any, config: Any, plan_name: str) -> type:
    """The plan's ``model_class`` where transformers builds it from ``config``, else the config's causal LM."""
    import transformers

    from hpgen.planner.model.load import model_and_config

    found = getattr(transformers, plan.model_class, None) if plan.model_class else None
    if isinstance(found, type) and isinstance(config, getattr(found, "config_class", ())):
        return found
    cls, _ = model_and_config(config)
    if plan.model_class and cls.__name__ != plan.model_class:
        raise HpgenError(
            f"model_class {plan.model_class!r} is not built from a {type(config).__name__} (that is {cls.__name__})",
            file=plan_name,
        )
    return cls


def _module_file(module_name: str) -> Path | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None
