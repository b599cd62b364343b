"""Local compute functions that the region-form tests bind through injections."""

from __future__ import annotations


def scaled_mlp(module, x, *, scale: float = 1.0):
    """The fixture MLP's own body, scaled: shows __hp_compute__ receives the module first."""
    return module._forward_impl(x) * scale
