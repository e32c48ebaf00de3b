"""Double of a builder that extends the base flags (``super().cxx_args()`` + its own)."""

from mindspeed.op_builder.builder import MindSpeedOpBuilder


class FusedAdamWV2OpBuilder(MindSpeedOpBuilder):
    OP_NAME = "npu_apply_fused_adamw_v2"

    def __init__(self):
        super().__init__(self.OP_NAME)

    def sources(self):
        return ["ops/csrc/cann/npu_apply_fused_adamw_v2.cpp"]

    def cxx_args(self):
        return super().cxx_args() + ["-Wno-narrowing"]
