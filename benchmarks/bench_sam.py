"""Replay benchmark of the SAM drafter on the Python standard library sources.

Run: ``python benchmarks/bench_sam.py`` (about 2-3 minutes on 2 cores; ``--quick`` for less).

Every text is tokenized with a byte-level BPE trained here on the same sources, then
replayed as if a model generated it: at each step the drafter has seen the text so far,
proposes k tokens, the longest prefix that equals the real continuation is accepted
(greedy verification) and the accepted tokens plus one are appended. Side by side, on
the same streams:

* ``sam``        this project's drafter with its defaults (flat arrays, numba, most recent
                 occurrence, min match 1, a match of length L drafts at most L tokens);
* ``sam-max``    the same without the length cap (most accepted tokens, lower share);
* ``sam-first``  sam-max drafting from the first occurrence (same semantics as the seed);
* ``sam-r4``     sam-max drafting from the most recent occurrence of the last 4 tokens only
                 (ASCEND_RL_SAM_RECENT_LEN=4: better token by token, worse per step);
* ``seed-py``    a re-implementation of the seed's design: pure-Python automaton with one
                 dict per state, first-occurrence drafting, no gate (the baseline);
* ``ngram5``     vLLM's n-gram proposer kernel (numba), prompt_lookup_min = max = 5;
* ``ngram2-5``   the same with min 2, max 5.

Reported: accepted tokens per step, share of draft tokens accepted, median / p99
microseconds per request per step at ~2K, ~8K and ~32K tokens of context (batched calls
divided by the batch size, as in a decode step; streams run on past the last mark so that
every sample comes from a full batch), bytes and GC-tracked objects per token,
and for sibling groups (near-duplicate files, GRPO-like) the gain from group-aware drafting.
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import platform
import sys
import sysconfig
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ascend_rl_plugins.features.sam.automaton import AutomatonPool  # noqa: E402

CONTEXT_MARKS = (2048, 8192, 32768)


# -- corpus -----------------------------------------------------------------------------------

def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    return [f for f in files if "site-packages" not in f and os.path.getsize(f) > 2000]


def train_tokenizer(files: list[str], vocab: int = 4096):
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer()
    texts = (open(f, encoding="utf-8", errors="replace").read() for f in files[::7])
    tok.train_from_iterator(texts, vocab_size=vocab, min_frequency=2, show_progress=False)
    return tok


def encode(tok, path: str) -> np.ndarray:
    return np.array(tok.encode(open(path, encoding="utf-8", errors="replace").read()).ids, np.int32)


# -- drafters ----------------------------------------------------------------------------------

class SeedStyleSAM:
    """Seed-style baseline: one dict per state, first occurrence, no minimum match."""

    def __init__(self):
        self.next = [{}]
        self.link = [-1]
        self.length = [0]
        self.firstpos = [-1]
        self.last = 0
        self.text: list[int] = []

    def extend(self, c: int) -> None:
        pos = len(self.text)
        self.text.append(c)
        cur = len(self.next)
        self.next.append({})
        self.length.append(self.length[self.last] + 1)
        self.link.append(0)
        self.firstpos.append(pos)
        p = self.last
        while p != -1 and c not in self.next[p]:
            self.next[p][c] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][c]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = len(self.next)
                self.next.append(dict(self.next[q]))
                self.length.append(self.length[p] + 1)
                self.link.append(self.link[q])
                self.firstpos.append(self.firstpos[q])
                while p != -1 and self.next[p].get(c) == q:
                    self.next[p][c] = clone
                    p = self.link[p]
                self.link[q] = clone
                self.link[cur] = clone
        self.last = cur

    def draft(self, k: int) -> list[int]:
        q = self.link[self.last]
        if q <= 0:
            return []
        start = self.firstpos[q] + 1
        return self.text[start:start + k]


def accepted_prefix(draft, truth) -> int:
    n = 0
    for a, b in zip(draft, truth):
        if a != b:
            break
        n += 1
    return n


class Result:
    def __init__(self, name: str):
        self.name = name
        self.steps = 0
        self.accepted = 0
        self.drafted = 0
        self.lat: dict[int, list[float]] = {m: [] for m in CONTEXT_MARKS}
        self.bytes_per_token = float("nan")
        self.objs_per_token = float("nan")

    def record(self, context: int, drafted: int, accepted: int, us: float, full: bool = True) -> None:
        """One verification step of one stream at ``context`` tokens. Only the first
        ``MEASURED[0]`` tokens of a stream count; its tail exists so that every stream is still
        running (the batch still full) when the slowest one passes the last context mark --
        latency is per request of a batched call, so a half-empty batch would inflate it."""
        if context >= MEASURED[0]:
            return
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if full:
            for m in CONTEXT_MARKS:
                if m - 1024 <= context <= m:
                    self.lat[m].append(us)


MEASURED = [1 << 62]  # tokens of each stream that count (set by main)


def replay_sam(streams, k, name, *, min_match=1, from_first=False, group_of=None,
               adaptive=False, recent_len=32) -> tuple[Result, AutomatonPool, list[int]]:
    """Replay all streams in lockstep, one batched ingest+draft call per step."""
    res = Result(name)
    pool = AutomatonPool(min_match=min_match, from_first=from_first, adaptive=adaptive,
                         recent_len=recent_len)
    autos = {}
    members = []
    for i in range(len(streams)):
        key = group_of[i] if group_of is not None else i
        if key not in autos:
            autos[key] = pool.new_automaton()
        members.append(pool.new_member(autos[key]))
    members = np.array(members, np.int64)
    pos = np.ones(len(streams), np.int64)  # tokens seen; start from the first token
    fresh = [s[:1] for s in streams]
    while True:
        live = [i for i in range(len(streams)) if pos[i] < len(streams[i])]
        if not live:
            break
        flat = np.concatenate([fresh[i] for i in live]).astype(np.int32)
        off = np.zeros(len(live) + 1, np.int64)
        off[1:] = np.cumsum([len(fresh[i]) for i in live])
        mids = members[live]  # the step's inputs are built outside the timed call, as for ngram
        t0 = time.perf_counter_ns()
        drafts, counts, _ = pool.ingest(mids, flat, off, k)
        dt = (time.perf_counter_ns() - t0) / 1e3 / len(live)
        for j, i in enumerate(live):
            s = streams[i]
            p = int(pos[i])
            d = drafts[j, : counts[j]]
            a = accepted_prefix(d.tolist(), s[p:p + k].tolist())
            res.record(p, len(d), a, dt, full=len(live) == len(streams))
            n = min(a + 1, len(s) - p)
            fresh[i] = s[p:p + n]
            pos[i] = p + n
    tokens = [pool.tokens(int(pool.members[m, 0])) for m in members]
    return res, pool, tokens


def replay_seed(streams, k) -> Result:
    res = Result("seed-py")
    sams = [SeedStyleSAM() for _ in streams]
    pos = [1] * len(streams)
    fresh = [s[:1].tolist() for s in streams]
    while True:
        live = [i for i in range(len(streams)) if pos[i] < len(streams[i])]
        if not live:
            break
        for i in live:
            s = streams[i]
            t0 = time.perf_counter_ns()
            sam = sams[i]
            for c in fresh[i]:
                sam.extend(c)
            d = sam.draft(k)
            dt = (time.perf_counter_ns() - t0) / 1e3
            p = pos[i]
            a = accepted_prefix(d, s[p:p + k].tolist())
            res.record(p, len(d), a, dt)  # one request per call: the batch does not matter
            n = min(a + 1, len(s) - p)
            fresh[i] = s[p:p + n].tolist()
            pos[i] = p + n
    return res


def replay_ngram(streams, k, min_n, max_n) -> Result | None:
    try:
        from numba import set_num_threads
        from vllm.v1.spec_decode.ngram_proposer import batch_propose_numba
        set_num_threads(1)  # as vLLM does below 8192 batch tokens; threads only add noise here
    except Exception as exc:  # vLLM not installed in this interpreter
        print(f"(vLLM n-gram drafter unavailable: {type(exc).__name__}: {exc})")
        return None
    res = Result(f"ngram{min_n}" if min_n == max_n else f"ngram{min_n}-{max_n}")
    width = max(len(s) for s in streams) + k + 1
    mat = np.zeros((len(streams), width), np.int32)
    for i, s in enumerate(streams):
        mat[i, : len(s)] = s
    ntok = np.ones(len(streams), np.int32)
    drafts = np.zeros((len(streams), k), np.int32)
    ndraft = np.zeros(len(streams), np.int32)
    while True:
        live = [i for i in range(len(streams)) if ntok[i] < len(streams[i])]
        if not live:
            break
        t0 = time.perf_counter_ns()
        batch_propose_numba(live, ntok, mat, min_n, max_n, width + 1, k, drafts, ndraft)
        dt = (time.perf_counter_ns() - t0) / 1e3 / len(live)
        for i in live:
            s = streams[i]
            p = int(ntok[i])
            d = drafts[i, : ndraft[i]].tolist()
            a = accepted_prefix(d, s[p:p + k].tolist())
            res.record(p, len(d), a, dt, full=len(live) == len(streams))
            ntok[i] = p + min(a + 1, len(s) - p)
    return res


# -- memory ----------------------------------------------------------------------------------------

def seed_memory(stream) -> tuple[float, float]:
    gc.collect()
    objs0 = len(gc.get_objects())
    tracemalloc.start()
    sam = SeedStyleSAM()
    for c in stream.tolist():
        sam.extend(c)
    cur, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    gc.collect()
    objs = len(gc.get_objects()) - objs0
    n = len(stream)
    del sam
    return cur / n, objs / n


def sam_memory(stream) -> tuple[float, float, float]:
    gc.collect()
    objs0 = len(gc.get_objects())
    pool = AutomatonPool()
    m = pool.new_member(pool.new_automaton())
    pool.extend_one(m, stream, k=0)
    gc.collect()
    objs = len(gc.get_objects()) - objs0
    n = len(stream)
    return pool.automaton_bytes(0) / n, pool.automaton_used_bytes(0) / n, objs / n


# -- report -----------------------------------------------------------------------------------------

def python_call_ns(n: int = 200_000) -> float:
    """Cost of an empty Python function call right now: ~40-80 ns on an idle modern core;
    several times that means the machine is contended and every latency below is inflated."""
    def f():
        return None
    t0 = time.perf_counter_ns()
    for _ in range(n):
        f()
    return (time.perf_counter_ns() - t0) / n


def pct(v, q):
    return float(np.percentile(v, q)) if v else float("nan")


def report(results, k):
    print(f"\n== replay, k={k} (acc/step: accepted draft tokens per verification step; share: "
          f"accepted / drafted; ratio: acc/step vs seed-py; latency per request per step)")
    head = f"{'drafter':<10} {'acc/step':>8} {'share':>6} {'ratio':>6}"
    for m in CONTEXT_MARKS:
        head += f" | {m // 1024:>2}K med/p99 us"
    print(head)
    base = next((r for r in results if r.name == "seed-py"), None)
    for r in results:
        aps = r.accepted / max(r.steps, 1)
        share = r.accepted / max(r.drafted, 1)
        ratio = aps / (base.accepted / max(base.steps, 1)) if base and base.accepted else float("nan")
        line = f"{r.name:<10} {aps:8.3f} {share:6.1%} {ratio:6.2f}"
        for m in CONTEXT_MARKS:
            line += f" | {pct(r.lat[m], 50):6.2f} / {pct(r.lat[m], 99):6.2f}"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8, help="concurrent long streams (batch)")
    ap.add_argument("--context", type=int, default=32768, help="tokens per long stream")
    ap.add_argument("--k", type=int, nargs="*", default=[3])
    ap.add_argument("--quick", action="store_true", help="4 streams of 8K tokens")
    ap.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size")
    args = ap.parse_args()
    if args.quick:
        args.streams, args.context = 4, 8192
    t_start = time.time()
    files = stdlib_files()
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cpus; "
          f"{len(files)} stdlib files")
    tok = train_tokenizer(files, args.vocab)
    # long streams: consecutive files of disjoint slices of the library (a long rollout each)
    streams = []
    order = files[3::5]
    j = 0
    for _ in range(args.streams):
        parts, n = [], 0
        while n < args.context and j < len(order):
            ids = encode(tok, order[j])
            parts.append(ids)
            n += len(ids)
            j += 1
        streams.append(np.concatenate(parts)[: args.context])
    # each stream then runs on (not counted) so that the batch is still full when the slowest
    # stream passes the last mark; the tails come from files no measured text uses
    tail_files = [f for f in files if f not in set(order[:j])][::-1]
    for i, st in enumerate(streams):
        parts, n = [st], 0
        while n < args.context // 2 and tail_files:
            ids = encode(tok, tail_files.pop())
            parts.append(ids)
            n += len(ids)
        streams[i] = np.concatenate(parts)[: args.context * 3 // 2]
    MEASURED[0] = args.context
    total = len(streams) * args.context
    print(f"{len(streams)} streams x {args.context} tokens = {total} tokens (BPE vocab "
          f"{tok.get_vocab_size()}); each stream runs on for another {args.context // 2} tokens "
          f"so the batch stays full up to the last mark")
    print(f"machine check: empty Python call {python_call_ns():.0f} ns, load average "
          f"{os.getloadavg()[0]:.2f}")

    # warm the jit
    replay_sam([streams[0][:300]], 3, "warm")
    for k in args.k:
        results = [replay_sam(streams, k, "sam", min_match=1, adaptive=True)[0],
                   replay_sam(streams, k, "sam-max", min_match=1)[0],
                   replay_sam(streams, k, "sam-first", min_match=1, from_first=True)[0],
                   replay_sam(streams, k, "sam-r4", min_match=1, recent_len=4)[0],
                   replay_seed(streams, k)]
        for lo, hi in ((5, 5), (2, 5)):
            r = replay_ngram(streams, k, lo, hi)
            if r is not None:
                results.append(r)
        report(results, k)

    # memory
    big = streams[0][: args.context]
    sb, su, so = sam_memory(big)
    pb, po = seed_memory(big)
    print(f"\n== memory at {len(big)} tokens of context")
    print(f"sam      {sb:7.1f} bytes/token allocated ({su:.1f} in use), {so:.4f} GC objects/token")
    print(f"seed-py  {pb:7.1f} bytes/token,                          {po:.2f} GC objects/token")

    # sibling groups: near-duplicate files (codec tables, generated modules) as GRPO siblings
    groups = [g for g in near_duplicate_groups(files, tok) if len(g) >= 3][:6]
    if groups:
        sib = [s for g in groups for s in g]
        gid = [i for i, g in enumerate(groups) for _ in g]
        print(f"\n== sibling groups: {len(groups)} groups, {len(sib)} texts, "
              f"{sum(len(s) for s in sib)} tokens, k=3")
        solo = replay_sam(sib, 3, "solo", min_match=1, adaptive=True)[0]
        lock = replay_sam(sib, 3, "group", group_of=gid, min_match=1, adaptive=True)[0]
        # GRPO long tail: siblings finish at different times; the last one sees the others
        # completed. Replay each group's members one after another in one automaton.
        tail = Result("group-tail")
        tail_solo = Result("solo-tail")
        for g in groups:
            for (dst, grouped) in ((tail, True), (tail_solo, False)):
                pool = AutomatonPool(min_match=1, adaptive=True)
                a = pool.new_automaton()
                for s in g:
                    if not grouped:
                        a = pool.new_automaton()
                    m = pool.new_member(a)
                    r = _replay_one(pool, m, s, 3)
                    if s is g[-1]:
                        dst.steps += r[0]
                        dst.drafted += r[1]
                        dst.accepted += r[2]
        for r in (solo, lock):
            print(f"{r.name:<11} all siblings concurrently: {r.accepted / r.steps:.3f} accepted/step, "
                  f"share {r.accepted / max(r.drafted, 1):.1%}")
        print(f"last sibling after the others finished: solo {tail_solo.accepted / tail_solo.steps:.3f}"
              f" vs group {tail.accepted / tail.steps:.3f} accepted/step "
              f"({(tail.accepted / tail.steps) / max(tail_solo.accepted / tail_solo.steps, 1e-9):.2f}x)")
    print(f"\nmachine check at the end: empty Python call {python_call_ns():.0f} ns, load "
          f"average {os.getloadavg()[0]:.2f}")
    print(f"total {time.time() - t_start:.0f} s")


def _replay_one(pool, m, s, k):
    steps = drafted = accepted = 0
    p, fresh = 1, s[:1]
    while p < len(s):
        d, _ = pool.extend_one(m, fresh, k)
        a = accepted_prefix(d, s[p:p + k].tolist())
        steps += 1
        drafted += len(d)
        accepted += a
        n = min(a + 1, len(s) - p)
        fresh = s[p:p + n]
        p += n
    return steps, drafted, accepted


def near_duplicate_groups(files, tok):
    """Files of one directory whose names share a stem pattern (cp125x codecs, mac_* ...)."""
    import re
    buckets: dict[tuple[str, str], list[str]] = {}
    for f in files:
        d, b = os.path.split(f)
        stem = re.sub(r"[0-9_]+", "", b[:-3])[:6]
        buckets.setdefault((d, stem), []).append(f)
    groups = []
    for (_, _), fs in sorted(buckets.items(), key=lambda kv: -len(kv[1])):
        if len(fs) < 3:
            continue
        ids = [encode(tok, f)[:4096] for f in fs[:4]]
        groups.append(ids)
    return groups


if __name__ == "__main__":
    main()
