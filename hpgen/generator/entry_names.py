"""Every plan entry names a module, and parameters, that the source builds.

``parallelize`` refuses a key that matches no module (``model.norrm``) and a parameter its
module lacks (``gate_projj.weight``), on the ranks, after the file was generated. Where the
source says so statically, ``hpgen lower`` (and ``explain``, ``check``) refuses them at
once, naming the plan's JSON path, with the close names.

Statically known means: each step of the FQN is a submodule that ``__init__`` builds as
``self.x = Cls(...)`` (or in ``nn.ModuleList([...])``), and the class of the last one is
defined in the file or is one of torch's modules whose parameters are fixed (``nn.Linear``:
``weight``, ``bias``). A name is refused only where the class's whole set of attributes is
known: no method of it or of its bases in the file sets one by a computed name, and its
other bases are ``nn.Module``, ``PreTrainedModel`` and the like, which add none, or one of
those torch modules, which adds its parameters. Anything
else (a submodule built by a function, a class from another file, ``nn.ModuleDict``, a
``*`` where the module is no list) is left to ``parallelize``; a wrong refusal would stop a
plan that runs.
"""

from __future__ import annotations

from hpgen.core.errors import HpgenError, did_you_mean
from hpgen.generator.index_records import ClassInfo, ModuleIndex
from hpgen.core.plan import Plan
from hpgen.generator.resolve import ResolvedClass, resolve_key, root_class

# Bases that give a module no submodule and no parameter of their own (by their last name).
_EMPTY_BASES = {"Module", "PreTrainedModel", "GenerationMixin", "GradientCheckpointingLayer", "object"}
# torch's modules (and transformers' Conv1D): their parameters, and no submodules.
_LEAF_PARAMS = {
    "Linear": ("weight", "bias"),
    "Embedding": ("weight",),
    "LayerNorm": ("weight", "bias"),
    "RMSNorm": ("weight",),
    "GroupNorm": ("weight", "bias"),
    "Conv1d": ("weight", "bias"),
    "Conv2d": ("weight", "bias"),
    "Conv1D": ("weight", "bias"),
}
# What ``self.x = Cls(...)`` builds that is a tensor, not a submodule.
_TENSORS = {"Parameter", "Buffer"}
_PARAM_PARTS = ("params", "deferred_bias_params", "grad_reduce_params")

Owner = ClassInfo | str  # a class of the file, or a class named as written (``nn.Linear``)


def check_entry_names(plan: Plan, index: ModuleIndex, resolved: dict[str, ResolvedClass], *, source_name: str) -> None:
    """Raise ``HpgenError`` for an entry key, or a parameter it names, that the source shows does not exist.

    ``resolved`` holds the boundaries' classes (their keys were checked when resolved).
    """
    walker = _Walker(plan, index, source_name)
    for key, entry in plan.entries.items():
        if entry.skip_source_lowering:
            continue
        found = resolved.get(key)
        if found is None:
            owner = walker.module(key)
        elif found.elsewhere:
            continue
        else:
            owner = walker.boundary(key, found)
        if owner is None:
            continue
        for part in _PARAM_PARTS:
            for name in getattr(entry, part):
                walker.parameter(owner, name, where=f'param_plan["{key}"].{part}["{name}"]')


class _Walker:
    def __init__(self, plan: Plan, index: ModuleIndex, source_name: str) -> None:
        self.plan = plan
        self.index = index
        self.source_name = source_name

    def fail(self, where: str, message: str) -> HpgenError:
        return HpgenError(message, file=self.plan.name, where=where)

    def module(self, key: str) -> Owner | None:
        """The class of the module at ``key``, None where the source does not say; an error where it has none."""
        try:
            owner: Owner | None = root_class(self.plan, self.index, key, source_name=self.source_name)
        except HpgenError:
            return None  # no root class to start from: the resolver says so where it matters
        segments = key.split(".")
        position = 0
        while owner is not None and position < len(segments):
            owner, position = self.step(owner, segments, position, where=f'param_plan["{key}"]')
        return owner

    def boundary(self, key: str, found: ResolvedClass) -> Owner | None:
        """The class of a boundary's module as the source builds it, None where it does not say.

        ``boundary_classes`` may name a base of the real class (``torch.nn.Embedding`` for a subclass
        with a norm of its own), so the source's own ``self.x = Cls(...)`` comes first.
        """
        try:
            owner = self.module(key)
        except HpgenError:  # a key the resolver accepted through boundary_classes
            owner = None
        if owner is not None:
            return owner
        if self.plan.boundary_class_for(key) is not None:
            return None if found.external else self.index.classes.get(found.name)
        return found.name if found.external else self.index.classes.get(found.name)

    def parameter(self, owner: Owner, name: str, *, where: str) -> None:
        """Refuse parameter ``name`` of the module ``owner`` where the source shows it has none."""
        segments = name.split(".")
        position = 0
        while owner is not None and position < len(segments) - 1:
            owner, position = self.step(owner, segments, position, where=where)
        if owner is None or position != len(segments) - 1:
            return  # unknown, or a path ending in a list index: no parameter the source can show
        last = segments[-1]
        names = self.parameter_names(owner)
        if names is None or last in names:
            return
        close = did_you_mean(last, self.nearby(owner), shown=lambda found: ".".join([*segments[:-1], found]))
        if isinstance(owner, str):
            raise self.fail(where, f"{owner} has no parameter {last!r}{close} (its parameters: {', '.join(sorted(names))})")
        raise self.fail(where, f"{owner.name}.__init__ assigns no parameter {last!r}{close}")

    def step(self, owner: Owner, segments: list[str], position: int, *, where: str) -> tuple[Owner | None, int]:
        """Walk one segment down from ``owner``: the next owner and position, (None, _) where unknown."""
        segment = segments[position]
        if isinstance(owner, str):
            if self.leaf(owner) is not None:  # torch's leaf module: no submodules at all
                raise self.fail(where, f"{owner} has no submodule {segment!r} (its parameters: {', '.join(self.leaf(owner))})")
            return None, position
        if segment == "*" or segment.isdigit():
            return None, position  # a module that is no list: '*' may match anything
        for info in self.index.lineage(owner):
            children = info.children.get(segment)
            if not children:
                continue
            if len({(child.class_name, child.is_list) for child in children}) != 1:
                return None, position
            child = children[0]
            if _is_tensor(child.class_name):
                return None, position  # a parameter, not a module: the runtime says what is wrong
            position += 1
            if child.is_list:
                if position >= len(segments) or not (segments[position] == "*" or segments[position].isdigit()):
                    return None, position
                position += 1
            inner = self.index.class_named(child.class_name)
            return (inner if inner is not None else child.class_name), position
        if not self.complete(owner) or any(segment in info.attributes or segment in info.members for info in self.index.lineage(owner)):
            return None, position  # set some other way (a factory, setattr): the source does not say what
        close = did_you_mean(
            segment, self.submodules(owner), shown=lambda found: ".".join([*segments[:position], found, *segments[position + 1 :]])
        )
        raise self.fail(where, f"{owner.name}.__init__ assigns no submodule {segment!r}{close}")

    def leaf(self, name: str) -> tuple[str, ...] | None:
        return _LEAF_PARAMS.get(name.rsplit(".", 1)[-1])

    def complete(self, info: ClassInfo) -> bool:
        """Whether the source shows every attribute ``info``'s instances can have."""
        for current in self.index.lineage(info):
            if current.dynamic_attributes or len(current.definition_lines) > 1:  # defined twice: refused elsewhere
                return False
            for base in current.bases:
                if base not in self.index.classes and base.rsplit(".", 1)[-1] not in _EMPTY_BASES and not self.leaf(base):
                    return False
        return True

    def submodules(self, info: ClassInfo) -> list[str]:
        return [
            name
            for current in self.index.lineage(info)
            for name, children in current.children.items()
            if not _is_tensor(children[0].class_name)
        ]

    def parameter_names(self, owner: Owner) -> set[str] | None:
        """What a parameter of ``owner`` may be called, None where the source does not say."""
        if isinstance(owner, str):
            leaf = self.leaf(owner)
            return set(leaf) if leaf is not None else None
        if not self.complete(owner):
            return None
        names: set[str] = set()
        for info in self.index.lineage(owner):
            names |= info.attributes | set(info.members)
            names |= {param for base in info.bases for param in self.leaf(base) or ()}  # nn.Embedding's weight
        return names - set(self.submodules(owner))

    def nearby(self, owner: Owner) -> list[str]:
        """The names a misspelt parameter is compared with: the parameters and ``child.weight``-like paths."""
        if isinstance(owner, str):
            return list(self.leaf(owner) or ())
        found = sorted(self.parameter_names(owner) or ())
        for info in self.index.lineage(owner):
            for name, children in info.children.items():
                if _is_tensor(children[0].class_name):
                    continue
                params = self.leaf(children[0].class_name)
                inner = self.index.class_named(children[0].class_name)
                if params is None and inner is not None and not children[0].is_list:
                    params = tuple(sorted(self.parameter_names(inner) or ()))
                found += [f"{name}.{param}" for param in params or ()]
        return found



def _is_tensor(class_name: str) -> bool:
    return class_name.rsplit(".", 1)[-1] in _TENSORS
