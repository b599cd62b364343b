"""A block's reduction of a column-sharded value's features, read from source (hpgen.planner.passes.feature_statistics)."""

from __future__ import annotations


def test_feature_statistics_follow_the_column_output_into_methods() -> None:
    import ast
    import textwrap
    from types import SimpleNamespace

    from hpgen.planner.passes.feature_statistics import feature_statistics

    source = textwrap.dedent(
        """
        class M:
            def forward(self, x):
                g = self.gate(x)
                if self.sparse > 0.0:
                    g = self._top(g)
                u = self.up(x).mean(dim=0)
                return self.down(g * u)
            def _top(self, h):
                return h - torch.std(h, dim=-1, keepdim=True)
        """
    )
    tree = ast.parse(source)
    assert "M._top reduces the features of gate" in feature_statistics(tree, "M", {"gate", "up"}, SimpleNamespace(sparse=0.5))
    assert feature_statistics(tree, "M", {"gate", "up"}, SimpleNamespace(sparse=0.0)) is None  # branch not taken
    assert feature_statistics(tree, "M", {"up"}, SimpleNamespace(sparse=0.5)) is None  # a mean over dim 0 only
