"""The heads of one attention: how many query heads, how many key/value heads, and the size of one head."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Heads"]


class Heads(NamedTuple):
    """An attention's head counts and size (:meth:`hpgen.planner.derive.heads.rules.HeadRules.query_kv_heads`)."""

    query: int
    kv: int  # key/value heads (the query heads where the attention has no grouped key/value heads)
    head_dim: int

    @property
    def query_features(self) -> int:
        """The features of all query heads."""
        return self.query * self.head_dim

    @property
    def kv_features(self) -> int:
        """The features of all key/value heads."""
        return self.kv * self.head_dim
