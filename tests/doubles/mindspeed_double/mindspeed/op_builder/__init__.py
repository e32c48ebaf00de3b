"""Double of ``mindspeed/op_builder``: the base builder and two subclasses, one extending
``super().cxx_args()`` (as every builder but one does in MindSpeed 028de58) and the one that
does not."""

from .adaptive_recomputing_builder import AdaptiveRecomputingPluggableAllocatorBuilder
from .fused_adamw_v2_builder import FusedAdamWV2OpBuilder

__all__ = ["AdaptiveRecomputingPluggableAllocatorBuilder", "FusedAdamWV2OpBuilder"]
