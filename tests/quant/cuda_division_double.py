"""A double of CUDA's division semantics, for CPU tests: ``tensor / python_number`` becomes a
multiply by the float32 reciprocal of the number, as CUDA's true-division kernel computes it
when the divisor is a host scalar (the computation in the input's "opmath" type: float32
for bf16/fp16/float32, then rounded to the tensor's dtype). Divisions by a tensor are left
alone: on CUDA a divisor tensor on the device is divided exactly, and the quantizers put
their divisor tensors on the weight's device (``quant.device_math.constant``).

Why: a quantizer whose bits depend on how a device divides by a constant gives different
INT8/FP8/INT4 codes on an accelerator than the CPU kernels (issue 31 measured 1,910 INT8
codes and 21,931 block-FP8 codes differing on an H200). Under this mode the CPU shows the
same difference, so the tests can prove its absence without a GPU.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

_DIVISIONS = {torch.Tensor.div, torch.Tensor.div_, torch.Tensor.__truediv__, torch.Tensor.__itruediv__,
              torch.div, torch.true_divide, torch.Tensor.true_divide, torch.Tensor.true_divide_}
_IN_PLACE = {torch.Tensor.div_, torch.Tensor.__itruediv__, torch.Tensor.true_divide_}


class HostScalarReciprocalDivision(TorchFunctionMode):
    """Inside ``with HostScalarReciprocalDivision() as mode:``, floating ``tensor / number``
    is ``tensor * float32(1 / number)``; ``mode.rewritten`` counts the divisions it changed."""

    def __init__(self):
        super().__init__()
        self.rewritten = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in _DIVISIONS and len(args) == 2 and isinstance(args[0], torch.Tensor)
                and args[0].is_floating_point() and isinstance(args[1], (int, float))
                and not isinstance(args[1], bool) and kwargs.get("rounding_mode") is None and "out" not in kwargs):
            a, b = args
            self.rewritten += 1
            if a.dtype == torch.float64:
                result = a * (1.0 / float(b))
            else:
                reciprocal = torch.tensor(np.float32(1.0) / np.float32(b), dtype=torch.float32)
                result = (a.to(torch.float32) * reciprocal).to(a.dtype)
            if func in _IN_PLACE:
                return a.copy_(result)
            return result
        return func(*args, **kwargs)
