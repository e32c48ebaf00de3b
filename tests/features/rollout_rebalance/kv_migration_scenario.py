"""Running requests moved with their KV between independent vLLM 0.23 engines (CPU).

Three ``AsyncLLM`` replicas in one driver process, each with its own engine core process (no
shared process group, as verl 0.9's server replicas): A and B load the shipped
``MigrationKVConnector``, C a subclass that kills its engine core the moment a KV load
reaches it (``kv_migration_faults.DyingOnLoadConnector``). Each carries the connector through
``kv_transfer_config`` with ``kv_connector_module_path``: vLLM's own extension point.

``migration_runs`` starts the three engines once (an engine start costs far more than the
runs on this CPU) and makes every run on them, all requests concurrent, greedy, log-probs on,
each on a cleared prefix cache unless said otherwise:

- ``reference``: no migration (requests start alternately on A and B);
- ``moved``: every request moved A -> B -> A (``ForcedMigration``: after 8 and 16 tokens);
- ``planned_reference`` / ``planned``: the live trigger (``PlannedMigration``), six requests
  all started on A with B idle, against the same six unmoved (``test_kv_migration_planned``);
- ``destination_dies`` (last: it kills C; A and B live on): every request started on A and
  moved to C after 8 tokens; C dies while loading the first one, the others find it dead;
  each resumes on A.

Returns a :class:`MigrationRuns`: every request's tokens, log-probs, hops (replica, tokens
received there, outcome, the KV tokens vLLM reports cached on the hop's first output) and the
client's per-replica count of final outputs, for the tests to compare, and the seconds each
phase took (printed, never asserted).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from dataclasses import dataclass, field

from tests.support.phases import PhaseClock

PROMPT_LENGTHS = (5, 20, 37, 50)   # block size 16: moves land inside and across blocks
MAX_TOKENS = 24


@dataclass
class HopRecord:
    """One stretch of a request on one replica (``migration_client.Hop``, as the tests read it)."""

    replica: str
    tokens: int
    outcome: str
    loaded_from_export: bool
    export_found: bool | None
    cached_tokens: int | None
    prompt_tokens: int
    error: str | None


@dataclass
class Run:
    """One batch of concurrent requests through one ``MigratingClient``."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish: list[str | None]
    hops: list[list[HopRecord]]
    finished_on: dict[str, int]   # the client's count of final outputs per replica
    dead: list[str]
    exports_left: list[str]


@dataclass
class PlannedRun(Run):
    """A run under ``PlannedMigration``, with what the policy counted."""

    rounds: int = 0
    moves_planned: int = 0
    moves_started: int = 0
    skipped_unmovable: int = 0
    capacities: dict[str, list[int]] = field(default_factory=dict)   # replica: [slots, KV tokens]
    in_flight_left: int = 0


@dataclass
class MigrationRuns:
    reference: Run
    moved: Run
    planned_reference: Run
    planned: PlannedRun
    destination_dies: Run
    c_errored: bool
    a_errored: bool
    b_errored: bool
    seconds: dict[str, float]   # per phase (engine start, each run): where the time went


def _engine(model_dir: str, connector_class: str, module: str, store_dir: str,
            mooncake: dict | None = None):
    """One replica; ``mooncake`` (Mooncake settings): the Mooncake transport instead of the
    directory (its engine core a Mooncake client of its own)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from ascend_rl_plugins.features.rollout_rebalance.kv_migration import kv_transfer_config
    config = kv_transfer_config(store_dir, connector_class=connector_class, module=module,
                                mooncake=mooncake)
    args = AsyncEngineArgs(model=model_dir, dtype="float32", max_model_len=256, max_num_seqs=8,
                           max_num_batched_tokens=512, enforce_eager=True, block_size=16,
                           enable_prefix_caching=True, disable_log_stats=True, seed=0,
                           kv_transfer_config=KVTransferConfig(**config))
    return AsyncLLM.from_engine_args(args)


def _prompts(lengths=PROMPT_LENGTHS) -> list:
    return [[(7 * p + 13 * i) % 480 + 20 for i in range(n)] for p, n in enumerate(lengths)]


def _params(max_tokens: int = MAX_TOKENS, **sampling):
    from vllm import SamplingParams
    sampling = {"temperature": 0.0, **sampling}
    return SamplingParams(max_tokens=max_tokens, logprobs=0, ignore_eos=True, **sampling)


async def _run(client, label: str, starts: list, prompts: list | None = None,
               params: list | None = None, record: type = Run) -> Run:
    prompts = prompts or _prompts()
    params = params or [_params() for _ in prompts]
    outs = await asyncio.gather(*(client.generate(f"{label}-{i}", prompt, sampling, start)
                                  for i, (prompt, sampling, start)
                                  in enumerate(zip(prompts, params, starts))))
    return record(
        tokens=[list(o.token_ids) for o in outs],
        logprobs=[list(o.logprobs) for o in outs],
        finish=[o.finish_reason for o in outs],
        hops=[[HopRecord(replica=h.replica, tokens=h.tokens, outcome=h.outcome,
                         loaded_from_export=h.loaded_from is not None, export_found=h.export_found,
                         cached_tokens=h.cached_tokens, prompt_tokens=h.prompt_tokens, error=h.error)
               for h in o.hops] for o in outs],
        finished_on=dict(client.finished_on),
        dead=sorted(client.dead),
        exports_left=client.store.keys())


async def _start_engines(model_dir: str, store_dir: str, connectors: dict,
                         mooncake: dict | None = None) -> dict:
    """One ``AsyncLLM`` per replica name (``connectors``: name -> (connector class, module)),
    started concurrently: each start spawns an engine core interpreter that imports vLLM
    afresh (vLLM's CPU platform forces spawn), single-threaded work that two cores overlap.
    The front ends are built in worker threads with no event loop, so their output handlers
    start on this loop at the first request. If any start fails, the started ones are shut
    down and the first error is raised."""
    names = list(connectors)
    started = await asyncio.gather(*(asyncio.to_thread(_engine, model_dir, *connectors[name], store_dir,
                                                        mooncake)
                                      for name in names), return_exceptions=True)
    errors = [e for e in started if isinstance(e, BaseException)]
    if errors:
        for engine in started:
            if not isinstance(engine, BaseException):
                engine.shutdown()
        raise errors[0]
    return dict(zip(names, started))


# -- the live trigger: PlannedMigration (tail_policy.plan_moves on the client's bookkeeping) --

PLANNED_PROMPT_LENGTHS = (5, 20, 37, 50, 12, 28)
PLANNED_MAX_TOKENS = 64
REFUSED = 0   # this request has a presence penalty (greedy): refused by check_migratable


def _planned_params() -> list:
    return [_params(PLANNED_MAX_TOKENS, presence_penalty=0.5) if i == REFUSED
            else _params(PLANNED_MAX_TOKENS) for i in range(len(PLANNED_PROMPT_LENGTHS))]


async def _planned_runs(a, b, store) -> tuple[Run, PlannedRun]:
    """Six requests unmoved (alternating A/B), then all started on A with B idle while the
    planner moves the longest-remaining ones with their KV."""
    from ascend_rl_plugins.features.rollout_rebalance import tail_policy
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import MigratingClient, PlannedMigration
    n = len(PLANNED_PROMPT_LENGTHS)
    prompts = _prompts(PLANNED_PROMPT_LENGTHS)
    ref = await _run(MigratingClient({"A": a, "B": b}, store, policy=None), "planned-ref",
                     ["A" if i % 2 == 0 else "B" for i in range(n)], prompts, _planned_params())
    await _reset_prefix_caches(a, b)
    # the step model says what the planner weighs: a batch of 6 steps 6x slower than a
    # batch of 1 (CPU decode of the tiny model is not batch-bound; the default figures'
    # graph ladder pads every batch below 4 to 4 and so sees no gain here)
    policy = PlannedMigration(
        interval_s=0.05,
        step=tail_policy.StepCostModel(((1, 10.0), (8, 80.0)), attention_ms_per_token=0.0),
        settings=tail_policy.TailSettings(margin_s=0.0, growth_reserve_tokens=16))
    client = MigratingClient({"A": a, "B": b}, store, policy=policy)
    planned = await _run(client, "planned", ["A"] * n, prompts, _planned_params(), record=PlannedRun)
    planned.rounds, planned.moves_planned = policy.rounds, policy.planned
    planned.moves_started, planned.skipped_unmovable = policy.started, policy.skipped_unmovable
    planned.capacities = {k: [c.slots, c.kv_tokens] for k, c in policy.capacities.items()}
    planned.in_flight_left = len(client.in_flight)
    return ref, planned


async def _reset_prefix_caches(*engines) -> None:
    for engine in engines:
        await engine.reset_prefix_cache()


async def reference_and_moved(a, b, store, clock: PhaseClock, moved_label: str) -> tuple[Run, Run]:
    """The two runs every A/B migration scenario compares: the reference (requests alternating
    between A and B, no move), then, prefix caches reset, every request started on A and moved
    A -> B -> A after 8 tokens (two forced moves)."""
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import ForcedMigration, MigratingClient
    n = len(PROMPT_LENGTHS)
    ref = await _run(MigratingClient({"A": a, "B": b}, store), "ref",
                     ["A" if i % 2 == 0 else "B" for i in range(n)])
    clock.lap("reference")
    await _reset_prefix_caches(a, b)
    moved = await _run(MigratingClient({"A": a, "B": b}, store,
                                       policy=ForcedMigration(after_tokens=8, max_moves=2)),
                       "moved", ["A"] * n)
    clock.lap(moved_label)
    return ref, moved


async def _all_runs(model_dir: str, store_dir: str) -> MigrationRuns:
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import ForcedMigration, MigratingClient
    from ascend_rl_plugins.features.rollout_rebalance import kv_migration
    clock = PhaseClock()
    store = kv_migration.KVExportStore(store_dir)
    shipped = (kv_migration.CONNECTOR_CLASS, kv_migration.__name__)
    engines = await _start_engines(model_dir, store_dir, {
        "A": shipped, "B": shipped,
        "C": ("DyingOnLoadConnector", "tests.features.rollout_rebalance.kv_migration_faults")})
    a, b, c = engines["A"], engines["B"], engines["C"]
    clock.lap("start three engines")
    try:
        n = len(PROMPT_LENGTHS)
        ref, moved = await reference_and_moved(a, b, store, clock, "moved A->B->A")
        await _reset_prefix_caches(a, b)
        planned_ref, planned = await _planned_runs(a, b, store)
        clock.lap("planned (reference and planned)")
        dies = await _run(MigratingClient({"A": a, "C": c}, store,
                                          policy=ForcedMigration(after_tokens=8, max_moves=1)),
                          "dies", ["A"] * n)
        clock.lap("destination dies")
        return MigrationRuns(reference=ref, moved=moved, planned_reference=planned_ref, planned=planned,
                             destination_dies=dies, c_errored=bool(c.errored),
                             a_errored=bool(a.errored), b_errored=bool(b.errored), seconds=clock.seconds)
    finally:
        for engine in (a, b, c):
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - C is dead already
                pass


def migration_runs(model_dir: str) -> MigrationRuns:
    with tempfile.TemporaryDirectory(prefix="arp-kv-migration-",
                                     dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        return asyncio.run(_all_runs(model_dir, d))


# -- the same move across "hosts": the Mooncake transport ------------------------------------

@dataclass
class MooncakeRuns:
    reference: Run
    moved: Run
    source_dies: Run        # every request started on A', moved to B; A' dies after its export
    a_prime_errored: bool
    b_errored: bool
    seconds: dict[str, float]


SOURCE = "A'"   # the source that dies after its first export (kv_migration_faults)


async def _mooncake_runs(model_dir: str, store_dir: str, mooncake: dict, marker: str) -> MooncakeRuns:
    """A and B (the shipped connector) and A' (``DyingAfterExportConnector``) on the Mooncake
    transport: each engine core its own Mooncake client (its own derived ``local_hostname``),
    this driver one more (the client's store); the reference, then every request moved
    A -> B -> A; last (it kills A'), every request started on A' and moved to B after 8
    tokens, with the fault armed (``marker`` created): A' exits right after writing its first
    export, so that request can only go on from the export on the holder."""
    from ascend_rl_plugins.features.rollout_rebalance import kv_migration
    from ascend_rl_plugins.features.rollout_rebalance.migration_client import ForcedMigration, MigratingClient
    from ascend_rl_plugins.features.rollout_rebalance.mooncake_export_store import export_store
    from tests.features.rollout_rebalance import kv_migration_faults as faults
    clock = PhaseClock()
    store = export_store(kv_migration.kv_transfer_config(store_dir, mooncake=mooncake)
                         ["kv_connector_extra_config"])
    shipped = (kv_migration.CONNECTOR_CLASS, kv_migration.__name__)
    os.environ[faults.DIE_AFTER_EXPORT_MARKER_ENV] = marker   # the engine cores inherit it
    engines = await _start_engines(model_dir, store_dir, {
        "A": shipped, "B": shipped, SOURCE: ("DyingAfterExportConnector", faults.__name__)}, mooncake)
    a, b, source = engines["A"], engines["B"], engines[SOURCE]
    clock.lap("start three engines")
    try:
        ref, moved = await reference_and_moved(a, b, store, clock, "moved A->B->A over Mooncake")
        await _reset_prefix_caches(b, source)
        with open(marker, "w"):
            pass   # armed: A''s first export is its last act
        dies = await _run(MigratingClient({SOURCE: source, "B": b}, store,
                                          policy=ForcedMigration(after_tokens=8, max_moves=1)),
                          "source-dies", [SOURCE] * len(PROMPT_LENGTHS))
        clock.lap("source dies after its export")
        return MooncakeRuns(ref, moved, dies, a_prime_errored=bool(source.errored),
                            b_errored=bool(b.errored), seconds=clock.seconds)
    finally:
        for engine in (a, b, source):
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - A' is dead already
                pass


def mooncake_migration_runs(model_dir: str, mooncake: dict) -> MooncakeRuns:
    """:func:`_mooncake_runs`; ``store_dir`` is an empty directory no replica writes (the
    transport is Mooncake: the test checks it stays empty)."""
    with tempfile.TemporaryDirectory(prefix="arp-kv-migration-mooncake-") as d, \
            tempfile.TemporaryDirectory(prefix="arp-kv-migration-marker-") as m:
        runs = asyncio.run(_mooncake_runs(model_dir, d, mooncake, os.path.join(m, "die-after-export")))
        if os.listdir(d):
            raise AssertionError(f"the directory store was written: {os.listdir(d)}")
        return runs
