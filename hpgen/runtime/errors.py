"""The one exception ``parallelize`` raises for a model, plan and mesh that do not fit."""

from __future__ import annotations

__all__ = ["ParallelizeError"]


class ParallelizeError(ValueError):
    """The plan cannot be installed on this model and mesh; nothing was changed.

    ``parallelize`` checks everything before it touches a tensor, so when this is raised
    the model is exactly as it was. The message names the module FQN, the sizes involved
    and the mesh axis, and says what to change.
    """
