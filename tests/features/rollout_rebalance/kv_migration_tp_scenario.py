"""Running requests moved with their KV between two vLLM 0.23 engines at tensor_parallel_size=2
(CPU; issue 42, finding 1).

Two ``AsyncLLM`` replicas in one driver process, each an engine core process with two TP
worker processes (vLLM's multiproc executor; its CPU backend runs the TP collectives through
its shared-memory communicator), both loading the shipped ``MigrationKVConnector`` through
``kv_transfer_config``. The model is the tiny Qwen3 with two KV heads: each TP rank holds a
different one, so a rank that loaded the other rank's KV decodes differently (with the
default single KV head both ranks would hold the same, replicated head and nothing could
tell).

``tp_migration_runs`` starts both engines once and makes two runs on them, all requests
concurrent, greedy, log-probs on: ``reference`` (unmoved, requests alternately on A and B)
and ``moved`` (every request moved A -> B -> A after 8 and 16 tokens), on cleared prefix
caches.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from dataclasses import dataclass

from tests.features.rollout_rebalance.kv_migration_scenario import Run, reference_and_moved
from tests.support.phases import PhaseClock

TP = 2
KV_HEADS = 2   # one per TP rank


@dataclass
class TpMigrationRuns:
    reference: Run
    moved: Run
    a_errored: bool
    b_errored: bool
    seconds: dict[str, float]   # per phase (engine start, each run): where the time went


def model_path() -> str:
    """The tiny Qwen3 with one KV head per TP rank."""
    from ascend_rl_plugins.devtools import tiny_qwen3
    return tiny_qwen3.cached(num_key_value_heads=KV_HEADS)


def _engine(model_dir: str, store_dir: str):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from ascend_rl_plugins.features.rollout_rebalance.kv_migration import kv_transfer_config
    args = AsyncEngineArgs(model=model_dir, dtype="float32", max_model_len=256, max_num_seqs=8,
                           max_num_batched_tokens=512, enforce_eager=True, block_size=16,
                           enable_prefix_caching=True, disable_log_stats=True, seed=0,
                           tensor_parallel_size=TP,
                           kv_transfer_config=KVTransferConfig(**kv_transfer_config(store_dir)))
    return AsyncLLM.from_engine_args(args)


async def _runs(model_dir: str, store_dir: str) -> TpMigrationRuns:
    from ascend_rl_plugins.features.rollout_rebalance import kv_migration
    clock = PhaseClock()
    store = kv_migration.KVExportStore(store_dir)
    started = await asyncio.gather(*(asyncio.to_thread(_engine, model_dir, store_dir) for _ in "AB"),
                                   return_exceptions=True)
    errors = [e for e in started if isinstance(e, BaseException)]
    if errors:
        for engine in started:
            if not isinstance(engine, BaseException):
                engine.shutdown()
        raise errors[0]
    a, b = started
    clock.lap(f"start two engines at TP {TP}")
    try:
        ref, moved = await reference_and_moved(a, b, store, clock, "moved A->B->A")
        return TpMigrationRuns(reference=ref, moved=moved, a_errored=bool(a.errored),
                               b_errored=bool(b.errored), seconds=clock.seconds)
    finally:
        for engine in (a, b):
            engine.shutdown()


def tp_migration_runs(model_dir: str) -> TpMigrationRuns:
    with tempfile.TemporaryDirectory(prefix="arp-kv-migration-tp-",
                                     dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        return asyncio.run(_runs(model_dir, d))
