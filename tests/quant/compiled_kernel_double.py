"""A double of :func:`ascend_rl_plugins.quant.fused.compiled` (the accelerator's
compiler), for CPU tests of the first-use verification.

Each "compiled" kernel is its formula run eagerly -- the same math, no compiler -- except where
a test says the compiler gets it wrong:

* ``wrong_if(tensors)``: a kernel called with such inputs (one width, a SmoothQuant factor
  given, one dtype) reads its first input scaled by 1.5, so its scales come out wrong, as a
  miscompiled kernel's would. A kernel only ever sees inputs of its own variant, so this is a
  kernel wrong for that variant alone.
* ``max_skips_nan``: every kernel's max reduction skips NaN, as some compilers' do. For a
  scale that is an amax over ``|w|`` (never below 0), skipping a NaN is the same as reading it
  as 0, which is what the double does: a row, group or block holding a NaN gets a finite scale.

Why: the verification must catch a bad kernel whichever variant it is, before any weight runs
it; with the real compiler on CPU every variant is right, so nothing would show a gap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ascend_rl_plugins.quant import fused


@dataclass
class EagerCompiler:
    """``compiled`` is the drop-in for ``fused.compiled``; ``kernels`` lists the (kind, variant,
    static arguments) of every kernel asked for, in order."""

    wrong_if: Callable[[tuple], bool] = lambda tensors: False
    max_skips_nan: bool = False
    kernels: list = field(default_factory=list)

    def compiled(self, kind: str, variant: tuple = (), rows_args: tuple = (0,), **static):
        self.kernels.append((kind, variant, tuple(sorted(static.items()))))
        formula = fused._FORMULAS[kind]

        def kernel(*tensors):
            first, rest = tensors[0], tensors[1:]
            if self.max_skips_nan:
                first = torch.where(torch.isnan(first), torch.zeros_like(first), first)
            if self.wrong_if(tensors):
                first = (first.to(torch.float32) * 1.5).to(first.dtype)
            return formula(first, *rest, **static)
        return kernel
