"""Which class each boundary FQN is, read statically from ``__init__`` assignments.

``boundary_classes`` in the plan wins. Otherwise the walk starts at ``model_class`` (or
the single ``*ForCausalLM`` / top-level PreTrainedModel subclass) and follows
``self.<attr> = Class(...)`` and ``nn.ModuleList([Class(...) ...])`` one FQN segment at
a time, looking through base classes defined in the same file.

A plan whose boundaries live in several modeling files (a multimodal model whose language
model is another model's: GOT-OCR2's decoder layers are Qwen2's) names each boundary's
class by its qualified name, ``transformers.models.qwen2.modeling_qwen2.Qwen2Attention``.
Lowering a file takes the keys whose module is that file (the last module segment is the
file's stem) and leaves the others to the lowering of their own file (``elsewhere``).
Names under ``torch``/``nn`` are torch's classes, which no file lowers.

``owned_by_children`` uses the resolved boundaries the other way round: which ``forward``
arguments of a boundary its body only hands to child boundaries, whose own contracts then
own those arguments' gradients (docs/plan-format.md, undeclared inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from hpgen.core.decision import entry_decision
from hpgen.core.errors import HpgenError, did_you_mean
from hpgen.generator.index_records import ChildArgument, ClassInfo, ForwardInfo, ModuleIndex
from hpgen.core.plan import Plan, fqn_matches

# Classes not defined in the source that the runtime wraps with a wrapper of their own (others: the generic one).
WRAPPED_EXTERNAL = ("Embedding", "Linear", "Identity")
TORCH_MODULES = ("torch", "nn")  # prefixes of torch's own classes: there is no source to lower


@dataclass(frozen=True)
class ResolvedClass:
    """The class of a boundary: defined in the source, or external (``nn.Linear``)."""

    name: str
    external: bool
    elsewhere: bool = False  # a class of another modeling file, lowered from that file


def resolve_boundaries(plan: Plan, index: ModuleIndex, *, source_name: str) -> dict[str, ResolvedClass]:
    """Map each lowered boundary key of the plan to its class, or raise ``HpgenError``."""
    resolver = _Resolver(plan, index, source_name)
    return {
        key: resolver.resolve(key)
        for key, entry in plan.entries.items()
        if entry.is_boundary and not entry.skip_source_lowering
    }


def owned_by_children(
    plan: Plan, index: ModuleIndex, resolved: dict[str, ResolvedClass], key: str, forward: ForwardInfo | None
) -> frozenset[str]:
    """The ``forward`` parameters of boundary ``key`` that its body reads only by handing them, whole,
    to child boundaries that own their gradients (a parameter it never reads counts too).

    A child owns an argument when its entry declares that input (its transition's backward gives the
    whole gradient) or when hpgen rewrites the child (its own ``forward`` copies what it leaves undeclared,
    by this same rule). Where the body is replaced (an injection), nothing is owned.
    """
    if forward is None or entry_decision(plan, key).injection is not None:
        return frozenset()
    return frozenset(
        name
        for name, reads in forward.handed_on
        if all(_child_owns(plan, index, resolved, key, read) for read in reads)
    )


def _child_owns(
    plan: Plan, index: ModuleIndex, resolved: dict[str, ResolvedClass], key: str, read: ChildArgument
) -> bool:
    """Whether the child boundary ``self.<read.attr>`` of ``key`` owns the gradient of the argument ``read``."""
    fqn = f"{key}.{read.attr}"
    child_key = next((candidate for candidate in resolved if fqn_matches(candidate, fqn)), None)
    if child_key is None or resolved[child_key].external and not resolved[child_key].elsewhere:
        return False  # no boundary there, or one the runtime wraps: left as it was (copied)
    parameter = read.keyword
    if read.position is not None:  # the child's named parameter at that position (one in *args gets no copy there)
        forward = _forward_of(index, resolved[child_key])
        positional = [p for p in forward.parameters[1:] if p.kind in ("positional_only", "positional")] if forward else []
        if read.position >= len(positional):
            return False
        parameter = positional[read.position].name
    if not entry_decision(plan, child_key).is_identity:
        return True  # rewritten: its forward moves its declared inputs and copies its undeclared ones
    # An identity contract keeps the class as it is: it owns only the inputs its entry declares.
    return parameter is not None and parameter in plan.entries[child_key].input_names


def _forward_of(index: ModuleIndex, found: ResolvedClass) -> ForwardInfo | None:
    """The ``forward`` a class of this file runs: its own, else the first of its bases in the file."""
    info = index.class_named(found.name) if not found.external else None
    for current in index.lineage(info) if info is not None else ():
        if current.forward is not None:
            return current.forward
    return None


def resolve_key(plan: Plan, index: ModuleIndex, key: str, *, source_name: str) -> ResolvedClass:
    """The class of one entry key, boundary or not (an entry that only shards parameters)."""
    return _Resolver(plan, index, source_name).resolve(key)


def root_class(plan: Plan, index: ModuleIndex, key: str, *, source_name: str) -> ClassInfo:
    """The class the plan's FQNs start from (``model_class``, else the file's one causal LM); errors name ``key``."""
    return _Resolver(plan, index, source_name).root(key)


class _Resolver:
    def __init__(self, plan: Plan, index: ModuleIndex, source_name: str) -> None:
        self.plan = plan
        self.index = index
        self.source_name = source_name
        self._root: ClassInfo | None = None

    def fail(self, key: str, message: str) -> HpgenError:
        return HpgenError(message, file=self.plan.name, where=f'param_plan["{key}"]')

    def resolve(self, key: str) -> ResolvedClass:
        named = self.plan.boundary_class_for(key)
        if named is not None:
            return self.named_class(key, named)
        current: ClassInfo | str = self.root(key)
        in_list = False
        walked = [current.name]
        for position, segment in enumerate(key.split(".")):
            if in_list:
                if segment != "*" and not segment.isdigit():
                    raise self.fail(key, f"{'.'.join(walked)} is an nn.ModuleList: expected an index or '*', got {segment!r}")
                in_list = False
                walked.append(segment)
                continue
            if isinstance(current, str):
                raise self.unresolved(key, f"{current} is not defined in {self.source_name}, so its submodules are unknown")
            if segment == "*" or segment.isdigit():
                raise self.unresolved(key, f"{current.name} is not an nn.ModuleList, so {segment!r} matches nothing known")
            child = self.child(key, current, segment, position)
            walked.append(segment)
            in_list = child.is_list
            found = self.index.class_named(child.class_name)
            current = found if found is not None else child.class_name
        if in_list:
            raise self.unresolved(key, f"{key} is an nn.ModuleList, not one module; add '.*'")
        if isinstance(current, str):
            return self.external(key, current)
        return ResolvedClass(current.name, external=False)

    def named_class(self, key: str, name: str) -> ResolvedClass:
        if "." not in name:
            if self.index.class_named(name) is None:
                raise HpgenError(
                    f"class {name!r} is not defined in {self.source_name}",
                    file=self.plan.name,
                    where=f'boundary_classes["{key}"]',
                )
            return ResolvedClass(name, external=False)
        module, _, short = name.rpartition(".")
        if module.rpartition(".")[2] == PurePath(self.source_name).stem:
            return self.named_class(key, short)  # this file's class, by its qualified name
        if module.split(".", 1)[0] not in TORCH_MODULES and short not in WRAPPED_EXTERNAL:
            return ResolvedClass(name, external=True, elsewhere=True)
        return self.external(key, name)

    def external(self, key: str, name: str) -> ResolvedClass:
        # No file to rewrite: the runtime wraps the instance (nn.Embedding, nn.Linear, nn.Identity
        # by their own wrappers; any other class, nn.LayerNorm or peft's lora.Linear, by the
        # generic one around its own forward), whatever the contract. A bare name the file does
        # not define may be a class of this file hpgen cannot see (nested in another class): a
        # contract that moves values on it is refused rather than silently left unlowered.
        short = name.rsplit(".", 1)[-1]
        if "." not in name and short not in WRAPPED_EXTERNAL and not entry_decision(self.plan, key).is_identity:
            raise self.fail(
                key,
                f"its class {name} is not defined in {self.source_name} (at module level); if it is a class from "
                "outside the file, name it by its module in boundary_classes (e.g. 'torch.nn.LayerNorm') and the "
                "runtime wraps it",
            )
        return ResolvedClass(name, external=True)

    def unresolved(self, key: str, why: str) -> HpgenError:
        return self.fail(key, f"cannot resolve the class of this FQN: {why}; add it to boundary_classes")

    def root(self, key: str) -> ClassInfo:
        if self._root is not None:
            return self._root
        if self.plan.model_class is not None:
            found = self.index.class_named(self.plan.model_class)
            if found is None:
                raise HpgenError(
                    f"class {self.plan.model_class!r} is not defined in {self.source_name}",
                    file=self.plan.name,
                    where="model_class",
                )
            self._root = found
            return found
        causal = [info for name, info in self.index.classes.items() if name.endswith("ForCausalLM")]
        if len(causal) != 1:
            causal = self.top_level_models()
        if len(causal) != 1:
            names = ", ".join(info.name for info in causal) or "none"
            raise self.unresolved(key, f"no single root model class (candidates: {names}); set model_class")
        self._root = causal[0]
        return self._root

    def top_level_models(self) -> list[ClassInfo]:
        """PreTrainedModel subclasses that no other class of the file builds."""
        used = {child.class_name for info in self.index.classes.values() for kids in info.children.values() for child in kids}
        return [
            info
            for info in self.index.classes.values()
            if info.name not in used and not info.name.endswith("PreTrainedModel") and self.is_pretrained(info)
        ]

    def is_pretrained(self, info: ClassInfo, depth: int = 0) -> bool:
        for base in info.bases:
            if base.rsplit(".", 1)[-1] == "PreTrainedModel":
                return True
            parent = self.index.class_named(base)
            if parent is not None and depth < 50 and self.is_pretrained(parent, depth + 1):
                return True
        return False

    def child(self, key: str, info: ClassInfo, attr: str, position: int):
        """The submodule class ``attr`` (segment ``position`` of ``key``) of ``info`` or of a base class in this file."""
        for current in self.index.lineage(info):
            children = current.children.get(attr)
            if children:
                names = sorted({(child.class_name, child.is_list) for child in children})
                if len(names) > 1:
                    where = ", ".join(f"{child.class_name} (line {child.line})" for child in children)
                    raise self.unresolved(key, f"{current.name}.{attr} is assigned more than one class: {where}")
                return children[0]
        known = [name for current in self.index.lineage(info) for name in current.children]
        segments = key.split(".")
        suggestion = did_you_mean(attr, known, shown=lambda name: ".".join([*segments[:position], name, *segments[position + 1 :]]))
        if suggestion:  # a typo in the plan, not a class hpgen cannot see
            raise self.fail(key, f"{info.name}.__init__ assigns no submodule {attr!r}{suggestion}")
        raise self.unresolved(key, f"{info.name}.__init__ assigns no submodule {attr!r}")
