"""The vocabulary: the input embedding vocab-parallel, the output projection column-parallel.

The embedding's rows are sharded (``S(0)``, the partial lookups all-reduced) and the
output projection's rows too (its logits gathered), where the vocabulary has at least
``--tp`` rows, the two are tied only to each other, and no ``forward`` of the file
computes with their weights directly (``F.linear(h, self.wte.weight)`` would compute with
a shard). Other lookup tables outside the layers as large as a quarter of the vocabulary
(learned positions in a small model, shape-id tables) are vocab-parallel too; a second
registration of a sharded parameter (BERT's ``predictions.bias``) gets the same layout.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from hpgen.core.placement import Placement, shard
from hpgen.planner.derive.placed import Derivation, Kind, Placed
from hpgen.planner.model.modules import is_nn_linear

__all__ = ["place_vocabulary"]


def place_vocabulary(model: Any, *, tp: int | None, source: Path, names: dict[int, str], result: Derivation) -> None:
    """Add the vocabulary's entries (and notes) to ``result``."""
    _Vocabulary(model, tp, source, names, result).run()


class _Vocabulary:
    def __init__(self, model: Any, tp: int | None, source: Path, names: dict[int, str], result: Derivation) -> None:
        self.model = model
        self.tp = tp
        self.source = source
        self.names = names
        self.modules = dict(model.named_modules())
        self.result = result

    def run(self) -> None:
        import torch.nn as nn

        get_in = getattr(self.model, "get_input_embeddings", None)
        get_out = getattr(self.model, "get_output_embeddings", None)
        try:
            embedding = get_in() if callable(get_in) else None
        except Exception:
            embedding = None
        try:
            head = get_out() if callable(get_out) else None
        except Exception:
            head = None
        raw = _raw_weight_reads(self.model, self.source)
        # one table and one output projection per codebook (MusicGen): each pair on its own
        embeddings = list(embedding) if _all_of(embedding, nn.Embedding) else [embedding]
        heads = list(head) if _all_of(head, nn.Linear) else [head]
        if len(heads) != len(embeddings):
            heads = heads + [None] * (len(embeddings) - len(heads)) if len(heads) < len(embeddings) else heads
            embeddings = embeddings + [None] * (len(heads) - len(embeddings))
        tables = True  # the other lookup tables, sized by the first vocab-parallel embedding
        for one_embedding, one_head in zip(embeddings, heads):
            tables = not self._place(one_embedding, one_head, raw, tables=tables) and tables

    def _place(self, embedding: Any, head: Any, raw: set[str], *, tables: bool) -> bool:
        """Place one embedding and output projection (and, with ``tables``, the other lookup tables after the
        embedding); whether the other tables were placed."""
        import torch.nn as nn

        emb_fqn = self.names.get(id(embedding)) if embedding is not None else None
        head_fqn = self.names.get(id(head)) if head is not None else None
        tied = (
            embedding is not None
            and head is not None
            and getattr(embedding, "weight", None) is getattr(head, "weight", None)
        )
        ok_emb = ok_head = False
        if emb_fqn and isinstance(embedding, nn.Embedding):
            reason = self._vocab_problem(emb_fqn, embedding.num_embeddings, raw)
            if reason:
                self.result.note(emb_fqn, False, reason)
            else:
                ok_emb = True
        elif emb_fqn:
            self.result.note(emb_fqn, False, f"the input embedding is a {type(embedding).__name__}, not nn.Embedding")
        if head_fqn and is_nn_linear(head) and set(dict(head.named_parameters())) - {"weight", "bias"}:
            extra = sorted(set(dict(head.named_parameters())) - {"weight", "bias"})
            self.result.note(head_fqn, False, f"the output projection also applies {', '.join(extra)} to the logits")
        elif head_fqn and is_nn_linear(head):
            reason = self._vocab_problem(head_fqn, head.out_features, raw)
            if reason:
                self.result.note(head_fqn, False, reason)
            else:
                ok_head = True
        elif head_fqn:
            self.result.note(head_fqn, False, f"the output projection is a {type(head).__name__}, not nn.Linear")
        if tied and not (ok_emb and ok_head):
            ok_emb = ok_head = False
        if ok_emb and not tied:
            other = self._computing_alias(embedding.weight, emb_fqn)
            if other:
                ok_emb = False
                self.result.note(emb_fqn, False, f"its weight is also {other}'s, which would compute with a shard")
        if ok_emb and emb_fqn:
            self.result.placed[emb_fqn] = Placed(
                emb_fqn, Kind.EMBEDDING, {"weight": shard(0)}, why="vocab-parallel embedding"
            )
            self.result.note(emb_fqn, True, "vocab-parallel embedding: rows S(0), the partial lookups all-reduced")
            self._aliases(emb_fqn, "weight", shard(0))
        placed_tables = bool(ok_emb and emb_fqn and tables)
        if placed_tables:
            self._other_tables(embedding.num_embeddings, raw)
        if ok_head and head_fqn:
            placed = Placed(head_fqn, Kind.LM_HEAD, {"weight": shard(0)}, why="column-parallel output projection")
            if head.bias is not None:
                placed.params["bias"] = shard(0)
                self._aliases(head_fqn, "bias", shard(0))
            self.result.placed[head_fqn] = placed
            self.result.note(head_fqn, True, "column-parallel output projection: vocabulary rows S(0), logits gathered")
            if not tied:
                self._aliases(head_fqn, "weight", shard(0))
        return placed_tables

    def _other_tables(self, word_rows: int, raw: set[str]) -> None:
        """Other lookup tables outside the layers (learned positions, shape ids) as large as a quarter of the
        vocabulary: vocab-parallel too. Each costs one all-reduce of its output, worth it only for a big table."""
        import torch.nn as nn

        for fqn, module in self.modules.items():
            if fqn in self.result.placed or not isinstance(module, nn.Embedding):
                continue
            if type(module).forward is not nn.Embedding.forward or any(part.isdigit() for part in fqn.split(".")):
                continue  # a subclass computing its own ids (OPT's learned positions), or a table inside a layer
            rows = module.num_embeddings
            if rows * 4 < word_rows or self._vocab_problem(fqn, rows, raw) or module.weight.dim() != 2:
                continue
            if any(
                p is module.weight
                for n, p in self.model.named_parameters(remove_duplicate=False)
                if not n.startswith(fqn + ".")
            ):
                continue  # tied to something else
            self.result.placed[fqn] = Placed(fqn, Kind.EMBEDDING, {"weight": shard(0)}, why="vocab-parallel table")
            self.result.note(
                fqn,
                True,
                f"vocab-parallel lookup table ({rows} rows, as large as {rows / word_rows:.0%} of the "
                "vocabulary): one more all-reduce per forward",
            )

    def _vocab_problem(self, fqn: str, rows: int, raw: set[str]) -> str | None:
        if self.tp is not None and rows < self.tp:
            return f"{rows} vocabulary rows, fewer than --tp {self.tp}"
        name = fqn.rpartition(".")[2]
        if name in raw:
            return f"other code reads {name}.weight directly (not through the module), which a shard would break"
        return None

    def _computing_alias(self, weight: Any, owner: str) -> str | None:
        """Another module (not an ``nn.Embedding``) registering ``weight``: a custom head using the tied table."""
        import torch.nn as nn

        for name, module in self.model.named_modules(remove_duplicate=False):
            if name == owner or isinstance(module, nn.Embedding):
                continue
            if any(param is weight for param in module._parameters.values()):
                return f"{name} ({type(module).__name__})"
        return None

    def _aliases(self, owner: str, leaf: str, placement: Placement) -> None:
        """Other registrations of ``owner.leaf`` (BERT's ``predictions.bias``, ProphetNet's second
        ``word_embeddings``): the same layout under that name; an ``nn.Embedding`` holding it is
        a vocab-parallel boundary too, since its lookups now see a shard."""
        import torch.nn as nn

        target = self.modules[owner]._parameters[leaf]
        for name, module in self.model.named_modules():
            if name == owner or name in self.result.placed:
                continue
            for attr, param in module._parameters.items():
                if param is not target:
                    continue
                if isinstance(module, nn.Embedding) and attr == "weight":
                    self.result.placed[name] = Placed(
                        name, Kind.EMBEDDING, {"weight": placement}, why="vocab-parallel embedding"
                    )
                    self.result.note(name, True, f"vocab-parallel embedding (its weight is {owner}.{leaf})")
                else:
                    self.result.placed[name] = Placed(
                        name, Kind.ALIAS, {attr: placement}, why=f"the same Parameter as {owner}.{leaf}"
                    )


def _all_of(module: Any, kind: type) -> bool:
    """A non-empty ``nn.ModuleList`` of ``kind`` modules."""
    import torch.nn as nn

    return isinstance(module, nn.ModuleList) and len(module) > 0 and all(isinstance(m, kind) for m in module)


def _raw_weight_reads(model: Any, source: Path) -> set[str]:
    """Attribute names ``x`` for which some ``forward`` of the file computes with ``<...>.x.weight`` itself.

    Reading its metadata (``self.lm_head.weight.dtype``) is fine; using the tensor
    (``F.linear(h, self.wte.weight)``) would compute with a shard.
    """
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return set()
    found: set[str] = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for function in cls.body:
            if not (isinstance(function, ast.FunctionDef) and function.name == "forward"):
                continue
            metadata = {
                id(node.value)
                for node in ast.walk(function)
                if isinstance(node, ast.Attribute)
                and node.attr in ("dtype", "device", "shape", "ndim", "requires_grad")
            }
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr == "weight"
                    and isinstance(node.value, ast.Attribute)
                    and id(node) not in metadata
                ):
                    found.add(node.value.attr)
    return found
