"""Non-finite QAT weights refused without a synchronization per layer (``ASCEND_RL_INT4_QAT_FINITE_CHECK``).

Why: a NaN or infinite weight must never be fake-quantized silently (its scale, codes and the
forward would be garbage), so ``quant.int4.fake_quantize`` checks that every group scale is
finite. Made at every call, that check is a device-to-host read: on an accelerator the host
waits for the device at every fake-quantized layer of every forward, and can no longer queue
the next kernels while the current matmul runs -- the per-call host time of the compiled
quantizer (about 0.1 ms on an H200 machine) then adds to every layer's forward instead of
hiding behind it.

With ``step`` (the default) each fake quantization hands its verdict (a 0-dim device bool,
computed inside the quantizer's kernel) to :data:`CHECKS`, which reads all pending verdicts
at once -- one synchronization -- before any ``torch.optim.Optimizer.step`` of the process
(Megatron's optimizers step a torch optimizer), and after every :data:`MAX_PENDING` verdicts
(forwards with no optimizer step: reference and old log-probs). A non-finite weight then
raises :class:`~ascend_rl_plugins.quant.device_math.NonFiniteWeightError` naming
every layer whose weight was not finite, before the optimizer applies the step -- later than
``immediate`` (which raises in the layer's forward, naming it, at one synchronization per
layer), never silently. On CPU the check is immediate either way (nothing to wait for).
"""

from __future__ import annotations

import dataclasses
from typing import Any

MAX_PENDING = 512


@dataclasses.dataclass
class PendingVerdict:
    """One fake quantization's "every weight is finite" (a 0-dim bool on its device), unread."""
    name: str
    all_finite: Any


@dataclasses.dataclass
class FiniteCheckStats:
    """Counters for tests and ``ascend-rl selftest``."""
    deferred: int = 0
    reads: int = 0            # synchronizations made to read pending verdicts


class DeferredFiniteChecks:
    """Per-process owner of the unread verdicts (one instance: :data:`CHECKS`)."""

    def __init__(self):
        self._pending: list[PendingVerdict] = []
        self._hook = None
        self.stats = FiniteCheckStats()

    def defer(self, all_finite, name: str | None) -> None:
        """Keep ``all_finite`` to read later (``fake_quantize(..., defer_finite=CHECKS.defer)``)."""
        self._ensure_hook()
        self._pending.append(PendingVerdict(name or "a QAT weight", all_finite))
        self.stats.deferred += 1
        if len(self._pending) >= MAX_PENDING:
            self.verify()

    def pending(self) -> int:
        return len(self._pending)

    def verify(self) -> None:
        """Read every pending verdict (one synchronization per device) and raise
        ``NonFiniteWeightError`` naming the weights that were not finite."""
        import torch
        from ...quant.device_math import refuse_nonfinite
        pending, self._pending = self._pending, []
        if not pending:
            return
        by_device: dict = {}
        for verdict in pending:
            by_device.setdefault(verdict.all_finite.device, []).append(verdict)
        bad = []
        for verdicts in by_device.values():
            flags = torch.stack([v.all_finite for v in verdicts]).cpu()
            self.stats.reads += 1
            if not bool(flags.all()):
                bad += [v.name for v, ok in zip(verdicts, flags.tolist()) if not ok]
        if bad:
            shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
            refuse_nonfinite("INT4 QAT fake quantization (checked before the optimizer step)", shown,
                             f"{len(bad)} of {len(pending)} fake-quantized weights since the last check")

    def _ensure_hook(self) -> None:
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook
            self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, optimizer, args, kwargs):
        self.verify()
        return None

    def reset(self) -> None:
        """Drop the pending verdicts unread, zero the counters and remove the optimizer hook."""
        self._pending = []
        self.stats = FiniteCheckStats()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


CHECKS = DeferredFiniteChecks()


def reset() -> None:
    CHECKS.reset()
