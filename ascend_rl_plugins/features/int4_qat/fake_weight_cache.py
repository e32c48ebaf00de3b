"""The fake-quantized weight computed once per optimizer step (``ASCEND_RL_INT4_QAT_FAKE_WEIGHT_CACHE=step``).

Why: without it every forward of a QAT layer fake-quantizes the layer's weight again -- once
per micro-batch, again for each activation-recompute forward -- although the weight only
changes at the optimizer step. On an accelerator that costs about as much as the layer's own
matmul (issue 31: 1.4x on an H200 for 4096 x 4096 over 8192 tokens). Within one optimizer step
the weight is the same tensor with the same bits, so its fake-quantized form is too: reusing it
is exact by construction (the same tensor object, not a recomputation).

What is cached, and when it is dropped (all of these, so that a stale entry cannot be used):

- only forwards with gradients enabled (training micro-batches and their recompute). No-grad
  forwards (old/ref log-probs, validation) compute afresh: a reference model never steps, and
  its entries would otherwise stay in device memory through the rollout;
- every entry is dropped at the start of any ``torch.optim.Optimizer.step`` in the process
  (``register_optimizer_step_pre_hook``): Megatron's optimizers step a torch optimizer before
  copying the updated main parameters into the model's weights through ``.data`` (which does
  not bump the weights' version counters), and the drop also frees the memory before the
  optimizer's own peak;
- an entry is used only while the weight's storage pointer, version counter, device, dtype,
  shape and strides are those it was computed from (an in-place write, ``param.data = ...``,
  an offload to the host and back all change one of them).

Memory: one fake-quantized tensor per in-scope weight from the first training forward of a step
to its optimizer step. The uncached path already keeps one per micro-batch in flight (the
matmul saves its weight for the backward), so with pipeline parallelism (several micro-batches
in flight) the cache lowers the peak; with one micro-batch at a time it adds at most one copy
of the in-scope weights between micro-batches. That is why it is a flag, off by default.

Not covered: a weight written outside an optimizer step through ``.data`` in place (same
pointer, same version) -- e.g. a custom loader between two training forwards of one step.
Call :func:`reset` after such a write.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable


@dataclasses.dataclass(frozen=True)
class WeightIdentity:
    """What must be unchanged for a cached fake weight to stand for the weight's current bits."""
    data_ptr: int
    version: int
    device: str
    dtype: str
    shape: tuple
    stride: tuple

    @classmethod
    def of(cls, weight) -> "WeightIdentity":
        return cls(weight.data_ptr(), weight._version, str(weight.device), str(weight.dtype),
                   tuple(weight.shape), tuple(weight.stride()))


@dataclasses.dataclass
class CacheEntry:
    identity: WeightIdentity
    fake: Any                  # the fake-quantized tensor (never modified in place)


@dataclasses.dataclass
class CacheStats:
    """Counters for tests and ``ascend-rl selftest``."""
    hits: int = 0
    misses: int = 0
    dropped_at_step: int = 0


class FakeWeightCache:
    """Per-process owner of the cached fake weights (one instance: :data:`CACHE`)."""

    def __init__(self):
        # weight -> {transform key -> entry}; weak on the weight (by identity: tensors do not compare
        # as dictionary keys), so a deleted model frees its entries. Made at first use (torch).
        self._entries = None
        self._hook = None
        self.stats = CacheStats()

    def fake_weight(self, weight, key: Hashable, transform: Callable):
        """``transform(weight)``, reused while the weight is unchanged within an optimizer step.
        The caller decides whether this forward may use the cache (gradients enabled)."""
        self._ensure_hook()
        if self._entries is None:
            self._entries = _weak_by_identity()
        per_weight = self._entries.setdefault(weight, {})
        identity = WeightIdentity.of(weight)
        entry = per_weight.get(key)
        if entry is not None and entry.identity == identity:
            self.stats.hits += 1
            return entry.fake
        self.stats.misses += 1
        fake = transform(weight)
        per_weight[key] = CacheEntry(identity, fake)
        return fake

    def drop_all(self) -> None:
        self.stats.dropped_at_step += self.cached_count()
        self._entries = None

    def cached_count(self) -> int:
        return 0 if self._entries is None else sum(len(v) for v in self._entries.values())

    def _ensure_hook(self) -> None:
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook
            self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, optimizer, args, kwargs):
        self.drop_all()
        return None

    def reset(self) -> None:
        """Drop every entry, zero the counters and remove the optimizer hook."""
        self._entries = None
        self.stats = CacheStats()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _weak_by_identity():
    from torch.utils.weak import WeakIdKeyDictionary
    return WeakIdKeyDictionary()


CACHE = FakeWeightCache()


def reset() -> None:
    """Drop every cached fake weight (after writing a weight in place outside an optimizer step)."""
    CACHE.reset()
