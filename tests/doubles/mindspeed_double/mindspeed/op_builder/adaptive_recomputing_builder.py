"""Double of the one builder whose ``cxx_args`` does not extend the base class's list."""

from mindspeed.op_builder.builder import MindSpeedOpBuilder


class AdaptiveRecomputingPluggableAllocatorBuilder(MindSpeedOpBuilder):
    NAME = "AdaptiveRecomputing"

    def __init__(self):
        super().__init__(self.NAME)

    def sources(self):
        return ["ops/csrc/pluggable_allocator/adaptive_recomputing/NpuCachingCustomAllocator.cpp"]

    def cxx_args(self):
        return ["-fPIC", "-O2"]
