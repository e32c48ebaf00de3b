"""The formulas this project's quantizers replace, written plainly in torch (any device).

Why they live in the package: the benchmark (``benchmarks/bench_low_precision.py``) and the
device self-test (``ascend-rl selftest``) compare against the same baselines, so a figure in
a README and a figure a user measures on their own accelerator mean the same thing. They are
this project's own re-implementations of the formulas as published (no slime, FlashRL or
DeepGEMM code), allocate on the weight's device, and are never used on a hot path.
"""

from __future__ import annotations


def slime_int4_quantize_pack(w, group: int):
    """slime-style INT4 rollout quantization: float32 scale amax/7, divide, round, clamp +-7,
    int8 codes, then compressed-tensors-style packing (offset 8, shift, sum)."""
    import torch
    x = w.float().reshape(w.shape[0], -1, group)
    scale = x.abs().amax(dim=-1, keepdim=True) / 7.0
    scale = scale.clamp(min=1e-8)
    q = torch.round(x / scale).clamp(-7, 7).to(torch.int8).reshape(w.shape)
    u = (q + 8).to(torch.int32).reshape(w.shape[0], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)
    packed = (u << shifts).sum(dim=-1, dtype=torch.int32)
    return packed, scale.squeeze(-1).to(torch.bfloat16)


def slime_fake_quant(w, group: int):
    """slime-style straight-through fake quantization (training forward): float32 amax/7,
    divide, round, clamp, multiply back, ``w + (q - w).detach()``."""
    import torch
    x = w.float().reshape(w.shape[0], -1, group)
    scale = x.abs().amax(dim=-1, keepdim=True) / 7.0
    scale = scale.clamp(min=1e-8)
    q = torch.round(x / scale).clamp(-7, 7) * scale
    q = q.reshape(w.shape).to(w.dtype)
    return w + (q - w).detach()


def slime_block_fp8(w, block=(128, 128)):
    """slime / DeepGEMM block FP8 cast: zero-padded float32 copy, amax clamped at 1e-4,
    multiply by the reciprocal scale, cast."""
    import torch
    m, n = w.shape
    bm, bn = block
    pm, pn = -(-m // bm) * bm, -(-n // bn) * bn
    x = torch.zeros((pm, pn), dtype=w.dtype, device=w.device)
    x[:m, :n] = w
    v = x.view(pm // bm, bm, pn // bn, bn)
    amax = v.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    q = (v * (1.0 / sf)).to(torch.float8_e4m3fn)
    return q.view(pm, pn)[:m, :n].contiguous(), sf.view(pm // bm, pn // bn)


def flashrl_int8_rows(w):
    """FlashRL-style per-row INT8 quantization: float32 copy, amax per row / 127, divide,
    round, clamp, int8 (full-size float32 temporaries)."""
    import torch
    x = w.float()
    scale = x.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.round(x / scale.clamp(min=1e-10)).clamp(-128, 127).to(torch.int8)
    return q, scale
