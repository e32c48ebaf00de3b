"""Test double: let vLLM's compressed-tensors config pick its FP8 W8A8 scheme on CPU.

Stock vLLM on CPU cannot serve an FP8 W8A8 checkpoint: ``CompressedTensorsConfig``
selects ``CompressedTensorsW8A8Fp8`` only when ``_check_scheme_supported(89)`` holds, and
the CPU platform reports no device capability (checked on this machine: vLLM 0.23 then
falls back to W8A16 FP8 and finds no kernel; vLLM 0.13 fails with "Found no NVIDIA
driver"). With this one check answered "yes" for capability 89, vLLM 0.23 builds the real
``CompressedTensorsW8A8Fp8`` scheme with its real CPU kernel
(``ChannelWiseTorchFP8ScaledMMLinearKernel``: ``torch._scaled_mm`` on CPU, per-token FP8
activations by ``QuantFP8``'s native path) for per-channel weights. Everything else is
real vLLM code. Not installed by the project, only by the FP8 engine tests; this
project's own FP8 platform check asks the same vLLM function, so it agrees.
"""

from __future__ import annotations


def install() -> None:
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)
    original = CompressedTensorsConfig.__dict__["_check_scheme_supported"]
    fn = original.__func__ if isinstance(original, staticmethod) else original

    def check(min_capability, error=True, match_exact=False):
        if min_capability == 89 and not match_exact:
            return True
        return fn(min_capability, error=error, match_exact=match_exact)

    CompressedTensorsConfig._check_scheme_supported = staticmethod(check)
