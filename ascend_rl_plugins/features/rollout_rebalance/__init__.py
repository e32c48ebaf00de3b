"""Rollout rebalance: move unfinished requests (with their KV cache) between DP ranks.

Why these patches exist: a synchronous RL rollout ends in a long tail. A few DP ranks still
decode many long responses in a large graph batch while others idle, and every rank steps at
the slowest one's pace. Every N engine steps the DP ranks share their load, compute the same
plan (``planner.py``) and migrate requests (``protocol.py``) so every rank can drop to a
smaller graph batch; at the end, outputs go back to the rank and order the caller expects
(``engine.py``). The Qwen3 RL recipe's verl patch 0011-verl-feature-enable_rollout_rebalance
(its ``features/rollout_optimize``) hooked the same
two points but relied on internals that no longer exist in vLLM 0.13/0.23 (graph-size config
key, ``CachedRequestState`` import path, ``Request.mm_hashes``, indexing the block table, a
profiling hook); this re-design re-admits requests through vLLM's own request path and its
prefix cache instead of rebuilding runner state by hand.

Where it applies: vLLM's in-process ``LLM`` with one engine per DP rank and a
``torch.distributed`` world (verl 0.6.x spmd rollout, external launcher). verl 0.9.x runs
rollouts through an async server (``AsyncLLM``, engine cores in subprocesses, DP through
vLLM's coordinator): ``LLM._run_engine`` and ``LLMEngine.step`` never run there, and the
design note in this feature's DESIGN.md says where rebalancing belongs for it.

Remove when: vLLM (or vLLM-Ascend) can migrate running requests between DP engines itself
(its DP coordinator balances only new requests today).

Only flags and patch declarations here; torch/vLLM/numpy are imported by the submodules,
lazily, when a patched function first runs.
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_ROLLOUT_REBALANCE", "bool", False,
    "Rebalance unfinished requests across DP ranks during in-process vLLM rollouts (one "
    "engine per DP rank, torch.distributed initialized).",
    aliases=("ROLLOUT_REBALANCE_ENABLE",), feature="rollout_rebalance")
INTERVAL = flags.define(
    "ASCEND_RL_ROLLOUT_REBALANCE_INTERVAL", "int", 64,
    "Engine steps between two rebalance checks (each check is one all-gather of the load).",
    minimum=1, feature="rollout_rebalance")
GRAPH_SIZES = flags.define(
    "ASCEND_RL_ROLLOUT_REBALANCE_GRAPH_SIZES", "list", (4, 8, 16, 32, 64),
    "Graph batch-size ladder the ranks run (pre-captured sizes); the planner aims at the "
    "smallest rung every rank can fit under.", minimum=1, feature="rollout_rebalance")
KV = flags.define(
    "ASCEND_RL_ROLLOUT_REBALANCE_KV", "enum", "auto",
    "How running requests move: 'auto' (KV transfer or recompute, whichever is cheaper per "
    "request), 'on' (always with their KV blocks), 'off' (always by recompute).",
    choices=("auto", "on", "off"), feature="rollout_rebalance")
LOG = flags.define(
    "ASCEND_RL_ROLLOUT_REBALANCE_LOG", "bool", False,
    "Log every migration round (rank, requests out/in, bytes, ms) and a per-generate summary.",
    feature="rollout_rebalance")

FEATURE = Feature("rollout_rebalance",
                  "rollout long tail: verl 0.9 router via router_config_path and KV migration between its "
                  "replicas through a vLLM KV connector (off by default; main_ppo via "
                  "agent_loop_manager_class); KV migration between DP ranks (verl 0.6)",
                  flag=ENABLE, replaces="Qwen3 RL recipe verl patch 0011-verl-feature-enable_rollout_rebalance",
                  switched_on_by="verl 0.9: the lines `ascend-rl router` prints (rollout.router_config_path; "
                                 "migration: `ascend-rl router --migration`); verl 0.6: `ASCEND_RL_ROLLOUT_REBALANCE`",
                  verified=Verified(
                      cpu_runtime="2 and 4 real vLLM engines + gloo (vLLM 0.13, 0.23), with "
                                  "injected protocol faults; planner property tests; protocol "
                                  "and its failure paths on 2-4 gloo processes; verl 0.9 router "
                                  "loaded by verl 0.9.1's router_config_path loader and driven "
                                  "by its LLMServerClient (Ray local); tail migration with KV "
                                  "between vLLM 0.23 AsyncLLM replicas through the KV "
                                  "connector, forced and planned (tail_policy) moves; planned "
                                  "moves in verl 0.9.1's rollout created as its trainer creates "
                                  "it from the printed config lines; the preemption hand-back: "
                                  "connector marks in a real vLLM 0.23 engine, and verl 0.9.1's "
                                  "rollout on small-KV replicas",
                      doubles="verl 0.9 router: vLLMHttpServer doubles (get_rollout_config, "
                              "generate) and a vLLM /metrics exposition double",
                      static="verl 0.9.1 async-server notice hook resolved in its source; "
                             "vLLM 0.23 and vLLM-Ascend 0.23 schedulers filling "
                             "SchedulerOutput.preempted_req_ids (the hand-back's mark)"),
                  stacks="recipe, current")

_WHY_STEP = ("a rebalance round must run between two engine steps, when the scheduler, block "
             "pool and output processor agree; LLMEngine.step is the last point in-process "
             "rollouts pass through each step")
_WHY_RUN = ("outputs of migrated requests finish on another rank: the generate loop must keep "
            "joining rounds until every rank is idle, then return each output exactly once "
            "and in the caller's order")
_REMOVE = "vLLM migrates running requests between DP engines itself"


@FEATURE.after("vllm.v1.engine.llm_engine:LLMEngine.step", name="rollout_rebalance.rebalance_after_step",
               dist="vllm", versions=">=0.13,<0.24", order=50, params=("self",), reason=_WHY_STEP,
               remove_when=_REMOVE,
               replaces="recipe verl patch 0011 (hook.after LLMEngine.step)")
def _rebalance_after_step(result, instance, args, kwargs):
    from . import engine
    return engine.after_step(result, instance)


# internal request id -> generator state (uint8 tensor) of a seeded request that migrated in;
# the runner hook below hands it over once the runner has created the request's generator
PENDING_GENERATORS: dict = {}


@FEATURE.after("vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
               name="rollout_rebalance.restore_generators", dist="vllm", versions=">=0.13,<0.24",
               order=50, params=("self", "scheduler_output"),
               reason="a seeded request that migrates must continue its random stream: the "
                      "runner creates the request's torch.Generator from SamplingParams.seed "
                      "in _update_states, before the step samples; right after it, the "
                      "generator gets the state read at the source (CPU, NPU and GPU runners "
                      "all come through here: vLLM-Ascend's NPUModelRunner subclasses it)",
               remove_when=_REMOVE, replaces="recipe verl patch 0011 (generator state not carried)")
def _restore_generators(result, instance, args, kwargs):
    if PENDING_GENERATORS:  # empty unless a seeded request just migrated in
        from . import engine
        scheduler_output = args[0] if args else kwargs.get("scheduler_output")
        engine.restore_generators(instance, scheduler_output)
    return result


def _run_engine(wrapped, instance, args, kwargs):
    from . import engine
    return engine.run_engine(wrapped, instance, args, kwargs)


FEATURE.wrap("vllm.entrypoints.llm:LLM._run_engine", _run_engine, dist="vllm",
             versions=">=0.13,<0.14", order=50, params=("self",), reason=_WHY_RUN,
             remove_when=_REMOVE, name="rollout_rebalance.run_engine_013",
             replaces="recipe verl patch 0011 (hook.before/after LLM._run_engine)",
             fixed_upstream="moved to vllm.entrypoints.offline_utils:OfflineInferenceMixin")
FEATURE.wrap("vllm.entrypoints.offline_utils:OfflineInferenceMixin._run_engine", _run_engine,
             dist="vllm", versions=">=0.23,<0.24", order=50, params=("self",),
             reason=_WHY_RUN + " (0.23: inherited from OfflineInferenceMixin, takes output_type)",
             remove_when=_REMOVE, name="rollout_rebalance.run_engine_023",
             replaces="recipe verl patch 0011 (hook.before/after LLM._run_engine)",
             fixed_upstream="lives in vllm.entrypoints.llm:LLM before vLLM 0.23")


# -- verl 0.9: the async-server rollout, through verl's own router plug-in point ----------

ROUTER_SIBLINGS = flags.define(
    "ASCEND_RL_ROUTER_SIBLINGS", "enum", "spread",
    "verl 0.9 router: where GRPO siblings (same prompt tokens) go: 'spread' (a replica holding "
    "the fewest siblings, then by load) or 'pack' (prefer a replica running a sibling: "
    "prefix-cache hits, less balance). Router YAML "
    "key: siblings.", choices=("spread", "pack"), feature="rollout_rebalance")
ROUTER_ORDER = flags.define(
    "ASCEND_RL_ROUTER_ORDER", "enum", "longest_first",
    "verl 0.9 router: order of the shared queue: 'longest_first' (expected size, from finished "
    "siblings, past steps of the prompt, the servers' mean length) or 'arrival'. Router YAML "
    "key: order.", choices=("longest_first", "arrival"), feature="rollout_rebalance")
ROUTER_KV_BUDGET = flags.define(
    "ASCEND_RL_ROUTER_KV_BUDGET", "float", 1.5,
    "verl 0.9 router: a replica takes another request while the expected final tokens of its "
    "requests stay within this multiple of its KV cache (read from vLLM's /metrics; an idle "
    "replica always takes one). Router YAML key: kv_budget.", minimum=0.05, maximum=16,
    feature="rollout_rebalance")
ROUTER_KV_RESERVE = flags.define(
    "ASCEND_RL_ROUTER_KV_RESERVE", "int", 2048,
    "verl 0.9 router: and only while the KV in use on the replica (vLLM's /metrics, plus prompts "
    "sent since) leaves every request there this many tokens to grow; 0: no such check. Router "
    "YAML key: kv_reserve.", minimum=0, feature="rollout_rebalance")
ROUTER_SLOTS = flags.define(
    "ASCEND_RL_ROUTER_SLOTS", "int", 0,
    "verl 0.9 router: requests in flight per replica; 0 takes the servers' max_num_seqs. Router "
    "YAML key: slots.", minimum=0, feature="rollout_rebalance")
ROUTER_LOAD = flags.define(
    "ASCEND_RL_ROUTER_LOAD", "enum", "auto",
    "verl 0.9 router: where replica load comes from: 'metrics' (vLLM's /metrics: KV cache size "
    "and use, mean generated length; needs rollout.disable_log_stats=False), 'requests' (its own "
    "request counts and slots only), 'auto' (metrics when the servers publish them). Router "
    "YAML key: load.", choices=("auto", "metrics", "requests"), feature="rollout_rebalance")
ROUTER_METRICS_INTERVAL = flags.define(
    "ASCEND_RL_ROUTER_METRICS_INTERVAL", "float", 1.0,
    "verl 0.9 router: seconds between two reads of every server's /metrics. Router YAML key: "
    "metrics_interval_s.", minimum=0.05, maximum=60, feature="rollout_rebalance")
MIGRATION = flags.define(
    "ASCEND_RL_ROLLOUT_MIGRATION", "enum", "off",
    "Tail migration with KV between vLLM 0.23 replicas: 'off' (no request moves) or 'planned' "
    "(every ASCEND_RL_ROLLOUT_MIGRATION_INTERVAL s, tail_policy.plan_moves on the requests in "
    "flight; its running-request moves run with their KV). On verl 0.9 it takes effect through "
    "the agent-loop manager and connector lines `ascend-rl router --migration` prints. Off by "
    "default: the planner's cost figures are uncalibrated.",
    choices=("off", "planned"), feature="rollout_rebalance")
MIGRATION_INTERVAL = flags.define(
    "ASCEND_RL_ROLLOUT_MIGRATION_INTERVAL", "float", 2.0,
    "Seconds between two migration plans of the planned policy (verl 0.9: each plan reads "
    "every replica's requests and their tokens so far, one Ray call per replica; "
    "MigratingClient: its own bookkeeping, moves at the request's next output).", minimum=0.01,
    maximum=600, feature="rollout_rebalance")
MIGRATION_STEP_MS = flags.define(
    "ASCEND_RL_ROLLOUT_MIGRATION_STEP_MS", "str", "",
    "The planned policy's decode step time of one replica by batch size, as batch:ms pairs "
    "(e.g. '1:10,8:80'; linear between, flat beyond); empty: the uncalibrated fit to the Qwen3 "
    "RL recipe's TPOT figures (graph ladder 4-64, attention over the KV held). Calibrate it "
    "for your replicas: the planner moves a request only where the step-time difference it "
    "predicts pays for the move.", feature="rollout_rebalance")
MIGRATION_MARGIN = flags.define(
    "ASCEND_RL_ROLLOUT_MIGRATION_MARGIN", "float", 1.0,
    "Seconds a planned move must gain beyond its own cost (tail_policy.TailSettings.margin_s).",
    minimum=0.0, maximum=600, feature="rollout_rebalance")
REQUEUE_PREEMPTED = flags.define(
    "ASCEND_RL_ROLLOUT_REQUEUE_PREEMPTED", "bool", False,
    "Preemption hand-back, with ASCEND_RL_ROLLOUT_MIGRATION=planned on verl 0.9: a request its "
    "vLLM replica preempts (recompute preemption: its KV freed) goes back to the router's shared "
    "queue, ahead of every request not yet started (the fewest generated tokens first: the "
    "earliest victim first), instead of waiting in that replica's own queue; it resumes by "
    "re-prefill wherever room comes first (the migration KV connector marks the preemption, "
    "the client aborts the hop and acquires it again). Pair it with the router settings "
    "kv_budget 16 and kv_reserve 512 (README: the simulator's best). Off by default: "
    "its gain is the simulator's, not measured on an NPU cluster.", feature="rollout_rebalance")
ROUTER_FLAGS = (ROUTER_SIBLINGS, ROUTER_ORDER, ROUTER_KV_BUDGET, ROUTER_KV_RESERVE, ROUTER_SLOTS,
                ROUTER_LOAD,
                ROUTER_METRICS_INTERVAL)

ROUTER_YAML = "router.yaml"  # package data next to this module


def router_yaml_path() -> str:
    """The shipped router YAML, where this installation has it."""
    import os
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), ROUTER_YAML)


def router_config_line() -> str:
    """The verl 0.9 config override that turns the router on (plus KV-aware load)."""
    return (f"actor_rollout_ref.rollout.router_config_path={router_yaml_path()} "
            f"actor_rollout_ref.rollout.disable_log_stats=False")


MANAGER_FQN = "ascend_rl_plugins.features.rollout_rebalance.verl_manager.MigratingAgentLoopManager"


def _hydra_value(value) -> str:
    """A dict as a Hydra override value (``{key:value,...}``; values here are plain words and paths)."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def connector_config_line(store_dir: str | None = None) -> str:
    """The verl 0.9 override that loads the migration KV connector into every vLLM server."""
    from .connector_config import kv_transfer_config
    return ("+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_transfer_config="
            + _hydra_value(kv_transfer_config(store_dir)))


def migration_config_lines(store_dir: str | None = None) -> list[str]:
    """Everything a verl 0.9 ``main_ppo`` run adds for tail migration (with the flag)."""
    return [router_config_line(),
            f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}",
            connector_config_line(store_dir)]


FEATURE.applies_through(
    dist="verl", versions=">=0.9,<0.10", point="verl's router plug-in (rollout.router_config_path)",
    how=lambda: (f"add `{router_config_line()}` (or print it: `ascend-rl router`); the router "
                 f"routes by expected work and KV room with a shared longest-first queue "
                 f"(DESIGN.md, 'verl 0.9: the router'). Tail migration with KV (off by default): export "
                 f"ASCEND_RL_ROLLOUT_MIGRATION=planned and add the lines `ascend-rl router "
                 f"--migration` prints: " + " ".join(migration_config_lines()[1:]) + ". With it, "
                 f"the preemption hand-back (off by default): ASCEND_RL_ROLLOUT_REQUEUE_PREEMPTED=1. "
                 f"The in-process rebalance hooks never run there."))

def register_cli(subparsers) -> None:
    """``ascend-rl router``: the verl 0.9 config line that loads the router."""
    p = subparsers.add_parser("router", help="print the verl 0.9 config overrides that load the "
                                             "rollout router (rollout_rebalance)")
    p.add_argument("--path", action="store_true", help="print only the router YAML's path")
    p.add_argument("--migration", action="store_true",
                   help="also print the lines for tail migration with KV (agent-loop manager, KV "
                        "connector); export ASCEND_RL_ROLLOUT_MIGRATION=planned with them")
    from ...cli import uses_flags
    uses_flags(p)  # the router reads ASCEND_RL_ROUTER_*: a value it would refuse stops here, as in doctor

    def run(args) -> int:
        import os
        path = router_yaml_path()
        if not os.path.isfile(path):
            print(f"ascend-rl router: {path} is missing from this installation", flush=True)
            return 1
        if args.path:
            print(path)
        elif args.migration:
            print("\n".join(migration_config_lines()))
        else:
            print(router_config_line())
        return 0
    p.set_defaults(func=run)


ASYNC_SERVER_NOTICE = (
    "ascend-rl rollout_rebalance: ASCEND_RL_ROLLOUT_REBALANCE is on, but verl 0.9 rolls out "
    "through an async server (vLLMHttpServer -> AsyncLLM, engine cores in their own "
    "processes, DP through vLLM's coordinator): LLM._run_engine and LLMEngine.step never run "
    "there, so nothing is rebalanced in-process. On verl 0.9 the long tail is this project's "
    "router, loaded by verl itself: add actor_rollout_ref.rollout.router_config_path=<the path "
    "`ascend-rl router` prints> (ascend_rl_plugins/features/rollout_rebalance/README.md).")


def _rebalance_requested() -> bool:
    return bool(ENABLE.value)


@FEATURE.before("verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.__init__",
                dist="verl", versions=">=0.9,<0.10", enabled_by=_rebalance_requested,
                params=("self",), name="rollout_rebalance.verl_async_server_notice",
                reason="verl 0.9.x has only the async-server rollout, where the in-process "
                       "hooks never run: with rebalancing requested, each server says so in "
                       "its log (once) instead of doing nothing silently",
                remove_when="rebalancing moves into vLLM's engine-core busy loop / DP "
                            "coordinator (design in DESIGN.md)")
def _async_server_notice(instance, args, kwargs):
    if not _NOTICE_GIVEN:
        _NOTICE_GIVEN.append(True)
        import logging
        logging.getLogger("ascend_rl_plugins").warning(ASYNC_SERVER_NOTICE)


_NOTICE_GIVEN: list = []

