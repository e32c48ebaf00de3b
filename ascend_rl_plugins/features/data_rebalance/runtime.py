"""The verl 0.6 glue: a worker group's ``generate_sequences`` dispatches in the planned order.

verl binds every registered worker method onto the driver-side worker group through
``verl.single_controller.ray.base.func_generator(wg, method_name, dispatch_fn, collect_fn,
execute_fn, blocking)``; the returned callable splits the DataProto argument into one
contiguous chunk per DP rank (``DataProto.chunk``), runs the workers and concatenates their
outputs in rank order. For ``generate_sequences`` this module wraps that callable:

1. the batch's prompts are identified by content (rows of ``input_ids``/``attention_mask``;
   consecutive equal rows are one GRPO group), their lengths read from ``attention_mask``;
2. :func:`planner.plan` orders the samples (``ASCEND_RL_DATA_REBALANCE_MODE``), estimating each
   prompt's response length from what this process saw it generate before (:class:`History`);
3. the DataProto is dispatched in that order (``DataProto.select_idxs``, a new object: the
   caller's batch is not touched), and the output is put back into the caller's order with
   ``DataProto.reorder`` before it is returned.

Only blocking calls whose dispatch splits the batch evenly over a known number of ranks are
rebalanced: verl's lazy n-d dispatch (``make_nd_compute_dataproto_dispatch_fn``, the number
of ranks is the mesh's DP size, queried once as verl's own dispatch does) and
``Dispatch.DP_COMPUTE_PROTO`` (the worker group's size); a batch whose size the rank count
does not divide passes through untouched. Everything else is returned unchanged.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("ascend_rl_plugins")

GENERATE = "generate_sequences"


def is_generate(method_name: str) -> bool:
    """``generate_sequences``, or its prefixed name on a colocated worker group
    (``actor_rollout_generate_sequences``)."""
    return method_name == GENERATE or method_name.endswith("_" + GENERATE)


def split_of(dispatch_fn):
    """How ``dispatch_fn`` splits a DataProto: ``("mesh", name)``, ``("world", None)`` or None
    (anything else: not rebalanced)."""
    from verl.single_controller.base import decorator
    if isinstance(dispatch_fn, functools.partial) and dispatch_fn.func is decorator.dispatch_lazy_compute_data_proto:
        return ("mesh", dispatch_fn.args[0]) if dispatch_fn.args else None
    if dispatch_fn is decorator.dispatch_dp_compute_data_proto:
        return ("world", None)
    return None


def wrap_generate(functor, self, method_name, dispatch_fn, collect_fn, execute_fn, blocking):
    """What ``func_generator`` returns, rebalanced when it is a generate call that can be."""
    if not blocking or not is_generate(method_name):
        return functor
    split = split_of(dispatch_fn)
    if split is None:
        log.info("ascend-rl data_rebalance: %s has a dispatch mode it does not know; left as is", method_name)
        return functor
    return RebalancedGenerate(functor, self, method_name, split)


# -- what the batch is ---------------------------------------------------------------------

@dataclass(frozen=True)
class Batch:
    keys: list  # one content key per group (bytes)
    group: np.ndarray  # group index of each sample
    prompt_len: np.ndarray


def describe(data) -> Batch:
    """Groups of equal prompts (by content) and prompt lengths of a generation DataProto."""
    ids = data.batch["input_ids"].numpy()
    mask = data.batch["attention_mask"].numpy()
    rows = len(ids)
    starts = np.flatnonzero(np.r_[True, np.any(ids[1:] != ids[:-1], axis=1) | np.any(mask[1:] != mask[:-1], axis=1)])
    run_of = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, rows]))
    run_keys = [hashlib.blake2b(ids[s].tobytes() + mask[s].tobytes(), digest_size=16).digest() for s in starts]
    index: dict = {}
    run_group = np.array([index.setdefault(k, len(index)) for k in run_keys], dtype=np.int64)
    keys = list(index)
    return Batch(keys, run_group[run_of], mask.sum(axis=1).astype(np.float64))


def response_lengths(out) -> tuple[np.ndarray, int]:
    """Generated tokens per output row, and the response width (the length limit)."""
    responses = out.batch["responses"]
    width = int(responses.shape[1])
    if "response_mask" in out.batch.keys():
        return out.batch["response_mask"].sum(dim=1).numpy().astype(np.float64), width
    return out.batch["attention_mask"][:, -width:].sum(dim=1).numpy().astype(np.float64), width


# -- what was seen before ----------------------------------------------------------------------

@dataclass
class History:
    """Per prompt (by content): an exponential average of its group's mean response length;
    plus the mean over everything seen (the estimate for a prompt never seen) and the widest
    response tensor (the response length limit). Bounded: the least recently updated
    prompts are forgotten beyond ``capacity``."""

    capacity: int = 1_000_000
    alpha: float = 0.5
    lengths: OrderedDict = field(default_factory=OrderedDict)
    overall: float | None = None
    max_len: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def estimate(self, keys: list) -> np.ndarray:
        """Estimated response length per group: its own average, else the overall mean (1.0
        before anything was seen: then every estimate is equal)."""
        default = self.overall if self.overall is not None else 1.0
        with self.lock:
            return np.array([self.lengths.get(k, default) for k in keys], dtype=np.float64)

    def observe(self, keys: list, group_means: np.ndarray, width: int) -> None:
        with self.lock:
            for key, value in zip(keys, group_means.tolist()):
                old = self.lengths.pop(key, None)
                self.lengths[key] = value if old is None else (1 - self.alpha) * old + self.alpha * value
            while len(self.lengths) > self.capacity:
                self.lengths.popitem(last=False)
            mean = float(np.mean(group_means)) if len(group_means) else None
            if mean is not None:
                self.overall = mean if self.overall is None else (1 - self.alpha) * self.overall + self.alpha * mean
            self.max_len = max(self.max_len, width)

    def clear(self) -> None:
        with self.lock:
            self.lengths.clear()
            self.overall, self.max_len = None, 0


HISTORY = History()


@dataclass
class Record:
    """The last rebalanced call of this process (for logs and tests)."""

    method: str = ""
    plan: object = None
    est: np.ndarray | None = None
    calls: int = 0


LAST = Record()


# -- the wrapper -------------------------------------------------------------------------------

class RebalancedGenerate:
    """A worker group's generate method that dispatches in the planned order and returns the
    outputs in the caller's order."""

    def __init__(self, functor, worker_group, method_name: str, split: tuple):
        self.functor = functor
        self.worker_group = worker_group
        self.method_name = method_name
        self.split = split

    def __repr__(self) -> str:
        return f"<rebalanced {self.method_name} of {type(self.worker_group).__name__}>"

    def ranks(self) -> int:
        kind, mesh = self.split
        wg = self.worker_group
        if kind == "world":
            return wg.world_size
        info = wg._dispatch_info.get(mesh)
        if info is None:  # what verl's lazy dispatch does on its first call, done once here
            info = wg._query_dispatch_info(mesh)
            wg._dispatch_info[mesh] = info
        return max(info) + 1

    def __call__(self, *args, **kwargs):
        from verl.protocol import DataProto
        if len(args) != 1 or kwargs or not isinstance(args[0], DataProto) or args[0].batch is None:
            return self.functor(*args, **kwargs)
        data = args[0]
        ranks = self.ranks()
        if ranks < 1 or len(data) % ranks or "input_ids" not in data.batch.keys():
            return self.functor(data)
        from . import model_from_flags, mode_from_flags
        from .planner import plan
        batch = describe(data)
        est = HISTORY.estimate(batch.keys)[batch.group]
        chosen = plan(est, batch.prompt_len, batch.group, ranks, model_from_flags(HISTORY.max_len),
                      mode_from_flags())
        LAST.method, LAST.plan, LAST.est = self.method_name, chosen, est
        LAST.calls += 1
        log.debug("ascend-rl data_rebalance: %s over %d ranks: %s (modeled %s)", self.method_name, ranks,
                  chosen.chosen, chosen.modeled)
        if chosen.is_identity:
            out = self.functor(data)
        else:
            out = self.functor(data.select_idxs(chosen.order))
            out.reorder(_restore_index(chosen.inverse(), len(out)))
        if not data.meta_info.get("validate", False):
            lengths, width = response_lengths(out)
            per_sample = lengths.reshape(len(data), -1).mean(axis=1)
            means = np.bincount(batch.group, per_sample) / np.bincount(batch.group)
            HISTORY.observe(batch.keys, means, width)
        return out


def _restore_index(inverse: np.ndarray, n_out: int):
    """Indices for ``DataProto.reorder`` that put the outputs of the dispatched order back into
    the caller's order (``k`` outputs per input sample when a rollout expands them)."""
    import torch
    k, rest = divmod(n_out, len(inverse))
    if rest or k == 0:
        raise RuntimeError(f"ascend-rl data_rebalance: generate_sequences returned {n_out} rows for "
                           f"{len(inverse)} inputs; cannot restore the caller's order "
                           f"(set ASCEND_RL_DATA_REBALANCE=0)")
    index = inverse if k == 1 else (inverse[:, None] * k + np.arange(k)).reshape(-1)
    return torch.from_numpy(np.ascontiguousarray(index))
