"""The migration protocol on a real gloo group, over a synthetic engine state (run on every
rank by ``tests.support.child.run_group``).

The synthetic adapter is this project's own interface (not a double of upstream code):
each request's "KV" is a tensor derived from its tokens, so a destination checks every byte
it receives, and requests are plain dict entries, so "where is each request" is exact.
Between rounds the ranks "decode": running requests grow, some finish, queued ones start.
"""

from __future__ import annotations

import datetime
import random

import torch
import torch.distributed as dist

from ascend_rl_plugins.features.rollout_rebalance import protocol
from ascend_rl_plugins.features.rollout_rebalance.planner import PlannerConfig, RankLoad

from . import faults

BLOCK = 4
MAX_NUM_SEQS = 6


def kv_of(tokens: list) -> torch.Tensor:
    n_blocks = len(tokens) // BLOCK
    t = torch.tensor(tokens[: n_blocks * BLOCK], dtype=torch.float32).reshape(n_blocks, BLOCK, 1)
    return torch.cat([t, t * 0.5], dim=2).to(torch.bfloat16)  # (blocks, block, K|V)


class Synthetic:
    """One rank's requests: id -> tokens, waiting flag, origin rank."""

    def __init__(self, rank: int, n: int, refuse_suffix: str | None = None):
        rng = random.Random(rank)
        self.rank = rank
        self.requests = {}
        for i in range(n):
            self.requests[f"r{rank}-{i}"] = {
                "tokens": [rng.randrange(1, 200) for _ in range(rng.randrange(3, 40))],
                "waiting": i >= MAX_NUM_SEQS, "origin": rank}
        self.refuse_suffix = refuse_suffix
        self.errors: list[str] = []

    def snapshot(self) -> RankLoad:
        running = [v for v in self.requests.values() if not v["waiting"]]
        return RankLoad.from_requests(
            self.rank, {k: (len(v["tokens"]), v["waiting"]) for k, v in self.requests.items()},
            kv_blocks_used=sum(len(v["tokens"]) // BLOCK + 1 for v in running),
            kv_blocks_total=400, block_size=BLOCK, max_num_seqs=MAX_NUM_SEQS)

    def extract(self, m):
        r = self.requests[m.request_id]
        meta = {"tokens": list(r["tokens"]), "waiting": r["waiting"], "origin": r["origin"]}
        return meta, (kv_of(r["tokens"]) if m.with_kv else None)

    def admit(self, meta, kv) -> bool:
        if self.refuse_suffix and meta["_id"].endswith(self.refuse_suffix):
            return False
        if kv is not None and not torch.equal(kv, kv_of(meta["tokens"])):
            self.errors.append("kv mismatch " + meta["_id"])
            return False
        if meta["_id"] in self.requests:
            self.errors.append("admitted twice " + meta["_id"])
            return False
        self.requests[meta["_id"]] = {"tokens": meta["tokens"], "waiting": meta["waiting"],
                                      "origin": meta["origin"]}
        return True

    def release(self, meta) -> None:
        del self.requests[meta["_id"]]

    def discard(self, meta) -> None:
        del self.requests[meta["_id"]]

    def decode(self, rng: random.Random, finish: int) -> list:
        """One engine step: running requests grow, ``finish`` of them end, queued ones start."""
        running = [k for k in sorted(self.requests) if not self.requests[k]["waiting"]]
        for k in running:
            self.requests[k]["tokens"].append(rng.randrange(1, 200))
        finished = running[:finish]
        for k in finished:
            del self.requests[k]
        queued = [k for k in sorted(self.requests) if self.requests[k]["waiting"]]
        n_running = len(running) - len(finished)
        for k in queued[: max(0, MAX_NUM_SEQS - n_running)]:
            self.requests[k]["waiting"] = False
        return finished


def run(counts: list, kv: bool = True, refuse: str | None = None, rounds: int = 3,
        finish: int = 1, fault: str | None = None, fault_ranks: list | None = None,
        group_timeout_s: float | None = None) -> dict:
    """``rounds`` rebalance rounds with a decode step after each; ``fault`` (see
    :mod:`.faults`) is injected on ``fault_ranks`` (default: every rank). A round that raises
    is recorded; after one that left peers waiting on a timed-out collective
    (``group_timeout_s``) no further round runs (the group is broken)."""
    rank = dist.get_rank()
    adapter = Synthetic(rank, counts[rank], refuse)
    kwargs = {} if group_timeout_s is None else {"timeout": datetime.timedelta(seconds=group_timeout_s)}
    group = dist.new_group(backend="gloo", **kwargs)
    injector = None
    if fault is not None and (fault_ranks is None or rank in fault_ranks):
        injector = faults.Injector(fault, Synthetic).install()
    config = PlannerConfig(graph_sizes=(2, 4, 6), kv_migration=kv, kv_bytes_per_token=1.0,
                           link_bytes_per_s=1e12, prefill_tokens_per_s=1.0)
    start = sorted(adapter.requests)
    stats, raised, finished = [], [], []
    rng = random.Random(100 + rank)
    for round_no in range(rounds):
        try:
            res = protocol.rebalance_round(adapter, group, config, working=True, log_moves=True)
            stats.append({"plan": res.plan_size, "sent": res.sent, "received": res.received,
                          "kept": res.kept, "bytes_sent": res.bytes_sent,
                          "bytes_received": res.bytes_received})
        except BaseException as exc:  # noqa: BLE001 - recorded: the test asserts how it failed
            raised.append({"round": round_no, "type": type(exc).__name__, "message": str(exc),
                           "held": sorted(adapter.requests)})
            if group_timeout_s is not None:
                break
        finished += adapter.decode(rng, finish)
    return {"start": start, "end": sorted(adapter.requests), "finished": finished,
            "stats": stats, "raised": raised, "errors": adapter.errors,
            "fault": injector.report() if injector else None}
