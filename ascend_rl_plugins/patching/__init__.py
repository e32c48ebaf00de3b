"""The patch framework: declarative, lazy, idempotent, revertible runtime patches.

It knows nothing about the features; they import it and declare their patches.
"""

from .core import REGISTRY, ConflictError, Feature, Outcome, Patch, PatchError, Verified

__all__ = ["REGISTRY", "ConflictError", "Feature", "Outcome", "Patch", "PatchError", "Verified"]
