"""Expert placement and an EPLB simulator for comparing reset-per-rollout with warm start.

The placement algorithm is a plain two-step balancer (the same shape of problem vLLM-
Ascend's policies solve): give the redundant slots to the experts with the highest load
per replica, then place replicas heaviest-first on the least-loaded device that still has
a free slot and does not hold that expert yet. Loads of an expert split evenly over its
replicas. It runs once per rebalance, never per token.

The simulator replays RL-like traces: expert popularity drifts slowly from one RL step
(rollout) to the next and fluctuates within a rollout; EPLB gathers loads for
``collect_iterations`` and installs a new placement ``wait_iterations`` later. The only
difference between the modes is the placement a rollout starts with: the initial one
(reset, the Qwen3 RL recipe's behaviour) or the last learned one (warm start).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


def replica_counts(load: np.ndarray, total_slots: int) -> np.ndarray:
    """One replica per expert, the redundant slots to the highest load-per-replica."""
    num_experts = load.shape[0]
    if total_slots < num_experts:
        raise ValueError(f"{total_slots} slots cannot hold {num_experts} experts")
    counts = np.ones(num_experts, dtype=np.int64)
    heap = [(-float(load[e]), e) for e in range(num_experts)]
    heapq.heapify(heap)
    for _ in range(total_slots - num_experts):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-float(load[e]) / counts[e], e))
    return counts


def balanced_placement(load, num_devices: int, slots_per_device: int) -> np.ndarray:
    """``(num_devices, slots_per_device)`` logical expert ids balancing ``load``."""
    load = np.asarray(load, dtype=np.float64)
    counts = replica_counts(load, num_devices * slots_per_device)
    replicas = np.repeat(np.arange(load.shape[0]), counts)
    weights = load[replicas] / counts[replicas]
    order = np.argsort(-weights, kind="stable")
    placement = np.full((num_devices, slots_per_device), -1, dtype=np.int64)
    used = np.zeros(num_devices, dtype=np.int64)
    device_load = np.zeros(num_devices)
    hosts = [set() for _ in range(num_devices)]
    for index in order:
        expert = int(replicas[index])
        free = used < slots_per_device
        candidates = [d for d in np.flatnonzero(free) if expert not in hosts[d]] or list(np.flatnonzero(free))
        device = min(candidates, key=lambda d: (device_load[d], d))
        placement[device, used[device]] = expert
        used[device] += 1
        device_load[device] += weights[index]
        hosts[device].add(expert)
    return placement


def initial_placement(num_experts: int, num_devices: int, slots_per_device: int) -> np.ndarray:
    """The placement an engine starts with: experts in order, redundant slots repeating
    the first experts (no load knowledge)."""
    ids = np.arange(num_devices * slots_per_device) % num_experts
    return ids.reshape(num_devices, slots_per_device)


def device_loads(placement: np.ndarray, load: np.ndarray) -> np.ndarray:
    """Per-device load when each expert's tokens split evenly over its replicas."""
    counts = np.bincount(placement.ravel(), minlength=load.shape[0])
    per_replica = load / np.maximum(counts, 1)
    return per_replica[placement].sum(axis=1)


def imbalance(placement: np.ndarray, load: np.ndarray) -> float:
    """max / mean device load (1.0 = perfectly balanced)."""
    loads = device_loads(placement, load)
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


@dataclass(frozen=True)
class TraceConfig:
    num_experts: int = 64
    num_devices: int = 8
    slots_per_device: int = 9  # one redundant expert per device
    num_layers: int = 4
    rollouts: int = 12
    iterations: int = 120  # decode iterations per rollout
    tokens_per_iteration: int = 4096
    skew: float = 1.0  # std of log-popularity: how uneven experts are
    drift: float = 0.1  # std of the log-popularity change per RL step
    jitter: float = 0.02  # std of the log-popularity change per iteration within a rollout
    collect_iterations: int = 40  # EPLB load-gathering window
    wait_iterations: int = 5  # planning + transfer delay before a new placement is live
    seed: int = 0

    def __post_init__(self):
        if self.num_devices * self.slots_per_device < self.num_experts:
            raise ValueError("num_devices * slots_per_device must be >= num_experts")
        for name in ("rollouts", "iterations", "collect_iterations", "num_layers", "tokens_per_iteration"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


def expert_load_trace(cfg: TraceConfig) -> np.ndarray:
    """Token counts ``[rollout, iteration, layer, expert]`` with slowly drifting popularity."""
    rng = np.random.default_rng(cfg.seed)
    logits = rng.normal(0.0, cfg.skew, size=(cfg.num_layers, cfg.num_experts))
    trace = np.empty((cfg.rollouts, cfg.iterations, cfg.num_layers, cfg.num_experts), dtype=np.int64)
    for r in range(cfg.rollouts):
        if r:
            logits = logits + rng.normal(0.0, cfg.drift, size=logits.shape)
        noise = rng.normal(0.0, cfg.jitter, size=(cfg.iterations, cfg.num_layers, cfg.num_experts)).cumsum(axis=0)
        z = logits[None] + noise
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        for i in range(cfg.iterations):
            for layer in range(cfg.num_layers):
                trace[r, i, layer] = rng.multinomial(cfg.tokens_per_iteration, p[i, layer])
    return trace


def simulate(trace: np.ndarray, cfg: TraceConfig, warm_start: bool) -> np.ndarray:
    """Imbalance ``[rollout, iteration, layer]`` of EPLB on ``trace``."""
    rollouts, iterations, layers, _ = trace.shape
    start = initial_placement(cfg.num_experts, cfg.num_devices, cfg.slots_per_device)
    current = [start.copy() for _ in range(layers)]
    out = np.empty((rollouts, iterations, layers))
    for r in range(rollouts):
        if not warm_start:
            current = [start.copy() for _ in range(layers)]
        window = np.zeros((layers, cfg.num_experts))
        pending = None  # (iteration it goes live, placements)
        gathered = 0
        for i in range(iterations):
            if pending is not None and i >= pending[0]:
                current, pending = pending[1], None
            for layer in range(layers):
                out[r, i, layer] = imbalance(current[layer], trace[r, i, layer].astype(np.float64))
            window += trace[r, i]
            gathered += 1
            if gathered == cfg.collect_iterations:
                planned = [balanced_placement(window[layer], cfg.num_devices, cfg.slots_per_device)
                           for layer in range(layers)]
                pending = (i + 1 + cfg.wait_iterations, planned)
                window[:] = 0
                gathered = 0
    return out


def first_window(cfg: TraceConfig) -> int:
    """Iterations of a rollout that run before its first rebalance can be live."""
    return cfg.collect_iterations + cfg.wait_iterations
