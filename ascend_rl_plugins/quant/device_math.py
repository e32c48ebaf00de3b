"""Arithmetic whose bits do not depend on the device, shared by every quantizer (torch imported lazily).

Why this module exists: the quantizers' stored scales and codes must be the same bits on a
CPU, an NPU and a GPU, because the trainer (QAT, on the accelerator) and the rollout reload
(on the accelerator) must agree with the offline converter and the CPU kernels. IEEE-754
fixes the result of ``a / b`` for two tensors, but not how a backend evaluates
``tensor / python_number``: CUDA's division kernel turns a host scalar divisor into a
multiplication by its float32 reciprocal (``a * (1 / b)``), which is 1 ulp off for some
``a`` and flips the rounding of a code that sits at a .5 tie. So every division by a
constant here divides by a **0-dim tensor on the dividend's device** (:func:`divide`),
which every backend evaluates as a true element-wise division. Multiplications, clamps,
comparisons, ``round`` (half to even) and casts have one IEEE result and need no care.

It also holds the refusal of non-finite weights (:class:`NonFiniteWeightError`): a NaN or
an infinity in a weight gives a NaN/inf scale, and the CPU kernels and the torch paths used
to turn that into *different* garbage. Every quantizer now checks the scales it wrote (a
NaN or inf anywhere in a group/row/block reaches its scale) and raises, naming the tensor.
"""

from __future__ import annotations

CPU_BLOCK_BYTES = 16 << 20        # CPU torch path: per-op overhead dominates below a few MiB
DEVICE_BLOCK_BYTES = 512 << 20    # accelerators: launch overhead per block, bandwidth-bound ops
DEVICE_BLOCK_FRACTION = 8         # ... but never more than 1/8 of the free device memory


class NonFiniteWeightError(ValueError):
    """A weight handed to a quantizer holds NaN or infinity: its scale would be NaN/inf and its
    codes meaningless. Raised instead of writing them (the message names the tensor)."""


_CONSTANTS: dict = {}  # (value, dtype, device) -> 0-dim tensor; per process, see reset_constants


def constant(value: float, where, dtype=None, *, shape: tuple = ()):
    """``value`` as a 0-dim tensor (float32 unless ``dtype``) on the device of ``where`` (a tensor
    or a device): a divisor every backend divides by exactly (a host scalar would be turned
    into a reciprocal multiply on CUDA), and an input the compiled formulas cannot fold into a
    constant (:mod:`.fused`). 0-dim, so it does not change the result dtype of ``x / constant``
    (type promotion treats it as a scalar); the constants used here (7, 7.5, 127, 448) are
    exact in bf16 and fp16 too. Made once per (value, dtype, device, shape) and process: the
    quantizers only read it.

    ``shape=(1,)`` is what the compiled formulas (:mod:`.fused`) take instead: dynamo turns a
    0-dim float64 tensor input into a Python float with a ``not isnan(t.item())`` guard, i.e.
    a device-to-host read (on an accelerator: a synchronization) at every call; a one-element
    tensor stays a tensor (its value is never guarded on, so it is never folded either)."""
    import torch
    dtype = dtype or torch.float32
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    key = (float(value), dtype, str(device), tuple(shape))
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.full(tuple(shape), value, dtype=dtype, device=device)
    return t


def reset_constants() -> None:
    """Drop the cached constants (tests; or to free them with their device)."""
    _CONSTANTS.clear()


def divide(x, value: float, *, inplace: bool = False):
    """``x / value`` evaluated as an IEEE division on every device (see the module docstring)."""
    c = constant(value, x)
    return x.div_(c) if inplace else x.div(c)


def require_finite(scale, what: str, name: str | None):
    """Raise :class:`NonFiniteWeightError` when any of the ``scale`` values a quantizer computed is
    NaN or infinite (which is the case exactly when its group, row or block holds a non-finite
    weight, or its scaled values overflow float32). One small reduction and one host sync."""
    import torch
    if scale.numel() == 0 or bool(torch.isfinite(scale).all()):
        return
    bad = int((~torch.isfinite(scale)).sum())
    refuse_nonfinite(what, name, f"{bad} of {scale.numel()} scales are not finite")


def refuse_nonfinite(what: str, name: str | None, detail: str):
    """Raise the :class:`NonFiniteWeightError` of a quantizer (``detail``: how much is non-finite)."""
    label = f"{name!r}" if name else "the weight"
    raise NonFiniteWeightError(
        f"{what}: {label} holds NaN or infinite values ({detail}); refusing to quantize it. Find where it "
        f"became non-finite (trainer loss/gradients, the weight transfer) -- quantizing it would give "
        f"meaningless codes")


def block_bytes_for(device, requested: int | None = None) -> int:
    """Working-set size per block of rows for the torch paths: ``requested`` when given, 16 MiB
    on CPU, else :data:`DEVICE_BLOCK_BYTES` capped at 1/8 of the free device memory (fewer,
    larger blocks: each block costs a handful of kernel launches)."""
    if requested is not None:
        return int(requested)
    if device.type == "cpu" or device.type == "meta":
        return CPU_BLOCK_BYTES
    free = free_device_bytes(device)
    if free is None:
        return DEVICE_BLOCK_BYTES
    return max(CPU_BLOCK_BYTES, min(DEVICE_BLOCK_BYTES, free // DEVICE_BLOCK_FRACTION))


def free_device_bytes(device) -> int | None:
    """Free memory of an accelerator (``torch.<type>.mem_get_info``: cuda, npu, xpu), or None."""
    import torch
    backend = getattr(torch, device.type, None)
    info = getattr(backend, "mem_get_info", None)
    if info is None:
        return None
    try:
        return int(info(device)[0])
    except Exception:  # noqa: BLE001 - a backend without the query: use the default size
        return None
