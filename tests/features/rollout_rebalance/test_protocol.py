"""The migration protocol on real gloo process groups, over a synthetic engine state.

The synthetic adapter is this project's own interface (not a double of upstream code): each
request's "KV" is a tensor derived from its tokens, so a destination can check every byte it
received. Exactness: after any number of rounds, every request exists on exactly one rank,
with its tokens and KV intact, including when destinations refuse some requests.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from rr_launch import run_group  # noqa: E402

SCENARIO = r"""
import random, torch
from ascend_rl_plugins.features.rollout_rebalance.planner import PlannerConfig, RankLoad
from ascend_rl_plugins.features.rollout_rebalance.protocol import rebalance_round

BLOCK = 4

def kv_of(tokens):
    n_blocks = len(tokens) // BLOCK
    t = torch.tensor(tokens[: n_blocks * BLOCK], dtype=torch.float32).reshape(n_blocks, BLOCK, 1)
    return torch.cat([t, t * 0.5], dim=2).to(torch.bfloat16)  # (blocks, block, K|V)

class Synthetic:
    def __init__(self, rank, n, refuse_suffix=None):
        rng = random.Random(rank)
        self.requests = {}
        for i in range(n):
            rid = f"r{rank}-{i}"
            self.requests[rid] = {"tokens": [rng.randrange(1, 200) for _ in range(rng.randrange(3, 40))],
                                  "waiting": i >= 6, "origin": rank}
        self.refuse_suffix = refuse_suffix
        self.errors = []

    def snapshot(self):
        return RankLoad.from_requests(RANK, {k: (len(v["tokens"]), v["waiting"])
                                            for k, v in self.requests.items()},
                                      kv_blocks_used=sum(len(v["tokens"]) // BLOCK + 1
                                                         for v in self.requests.values() if not v["waiting"]),
                                      kv_blocks_total=400, block_size=BLOCK, max_num_seqs=6)

    def extract(self, m):
        r = self.requests[m.request_id]
        return {"tokens": list(r["tokens"]), "waiting": r["waiting"], "origin": r["origin"]}, \
            (kv_of(r["tokens"]) if m.with_kv else None)

    def admit(self, meta, kv):
        if self.refuse_suffix and meta["_id"].endswith(self.refuse_suffix):
            return False
        if kv is not None and not torch.equal(kv, kv_of(meta["tokens"])):
            self.errors.append("kv mismatch " + meta["_id"])
            return False
        assert meta["_id"] not in self.requests, "duplicate " + meta["_id"]
        self.requests[meta["_id"]] = {"tokens": meta["tokens"], "waiting": meta["waiting"],
                                      "origin": meta["origin"]}
        return True

    def release(self, meta):
        del self.requests[meta["_id"]]

    def discard(self, meta):
        del self.requests[meta["_id"]]

counts = COUNTS
adapter = Synthetic(RANK, counts[RANK], REFUSE)
group = dist.new_group(backend="gloo")
config = PlannerConfig(graph_sizes=(2, 4, 6), kv_migration=KV, kv_bytes_per_token=1.0,
                       link_bytes_per_s=1e12, prefill_tokens_per_s=1.0)
before = sorted(adapter.requests)
stats = []
rng = random.Random(100 + RANK)
for round_no in range(ROUNDS):
    res = rebalance_round(adapter, group, config, working=True, log_moves=True)
    stats.append([res.plan_size, res.sent, res.received, res.kept, res.bytes_sent, res.bytes_received])
    # "decode": running requests grow, some finish, queued ones start
    for rid in sorted(adapter.requests):
        req = adapter.requests[rid]
        if not req["waiting"]:
            req["tokens"].append(rng.randrange(1, 200))
    running = [k for k in sorted(adapter.requests) if not adapter.requests[k]["waiting"]]
    for k in running[: FINISH]:
        adapter.requests[k]["done"] = True
    for k in [k for k in sorted(adapter.requests) if adapter.requests[k].get("done")]:
        adapter.requests[k]["waiting"] = None
    finished = {k: v for k, v in adapter.requests.items() if v["waiting"] is None}
    for k in finished:
        del adapter.requests[k]
    stats[-1].append(sorted(finished))
    queued = [k for k in sorted(adapter.requests) if adapter.requests[k]["waiting"]]
    n_running = sum(1 for v in adapter.requests.values() if not v["waiting"])
    for k in queued[: max(0, 6 - n_running)]:
        adapter.requests[k]["waiting"] = False
emit({"start": before, "end": sorted(adapter.requests), "stats": stats, "errors": adapter.errors})
"""


def run(world, counts, *, kv=True, refuse=None, rounds=3, finish=1):
    code = (SCENARIO.replace("COUNTS", repr(counts)).replace("REFUSE", repr(refuse))
            .replace("KV", repr(kv)).replace("ROUNDS", str(rounds)).replace("FINISH", str(finish)))
    return run_group(code, world, env={"ASCEND_RL_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"},
                     timeout=300)


def check_exactly_once(results):
    start = [rid for r in results for rid in r["start"]]
    assert len(start) == len(set(start))
    finished = [rid for r in results for s in r["stats"] for rid in s[-1]]
    end = [rid for r in results for rid in r["end"]]
    everything = finished + end
    assert sorted(everything) == sorted(start), "a request was lost or duplicated"
    assert not any(r["errors"] for r in results), [r["errors"] for r in results]


@pytest.mark.parametrize("kv", [True, False], ids=["kv", "recompute"])
def test_every_request_exactly_once_two_ranks(kv):
    results = run(2, [6, 0], kv=kv)
    check_exactly_once(results)
    moved = sum(s[1] for r in results for s in r["stats"])
    assert moved > 0
    if kv:
        assert sum(s[4] for r in results for s in r["stats"]) > 0  # KV bytes really travelled
    else:
        assert sum(s[4] for r in results for s in r["stats"]) == 0


def test_four_ranks_with_refusals_keep_requests_at_source():
    results = run(4, [16, 9, 0, 2], refuse="3", rounds=4)
    check_exactly_once(results)
    kept = sum(s[3] for r in results for s in r["stats"])
    sent = sum(s[1] for r in results for s in r["stats"])
    received = sum(s[2] for r in results for s in r["stats"])
    assert kept > 0 and sent > 0 and sent == received
    # refused requests never left their origin
    for rank, r in enumerate(results):
        for rid in r["end"]:
            if rid.endswith("3"):
                assert rid.startswith(f"r{rank}-")
