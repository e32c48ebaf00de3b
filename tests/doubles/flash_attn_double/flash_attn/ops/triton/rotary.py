"""Double of flash_attn.ops.triton.rotary: same name and parameters as the real Triton
kernel entry point; calling it is an error (it must never be picked on NPU)."""


def apply_rotary(x, cos, sin, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None,
                 interleaved=False, inplace=False, conjugate=False):
    raise RuntimeError("flash_attn double: the CUDA Triton rotary kernel was called")
