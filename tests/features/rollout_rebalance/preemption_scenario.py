"""The migration connector's preemption marks in a real vLLM 0.23 engine (CPU), run in a fresh
interpreter by ``tests.support.child``."""

from __future__ import annotations

from dataclasses import dataclass

# ten greedy requests of very different lengths on a KV cache of 11 blocks (1408 tokens for
# ~3000 tokens of demand): vLLM preempts
LENGTHS = [60, 420, 200, 380, 90, 300, 150, 400, 250, 330]


@dataclass
class PreemptionMarks:
    asked: list[str]        # export keys of the requests that asked for a mark (every other one)
    preempted: list[str]    # export keys of every request vLLM's scheduler preempted
    marked: list[str]       # export keys the connector marked in the store
    exports: list[str]      # exports left (none: no request was aborted)
    lengths: list[int]      # tokens each request generated
    tokens_match_unmarked_run: bool   # the same requests without migration params: same tokens


def connector_marks(store_dir: str) -> PreemptionMarks:
    """One in-process engine with ``MigrationKVConnector``; every request names an export key
    and every other one asks for a preemption mark. vLLM's own preemptions are recorded by a
    wrapper on ``Scheduler._preempt_request`` (the request's export key), to compare with the
    marks the connector wrote from ``SchedulerOutput.preempted_req_ids``."""
    import wrapt
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.scheduler import Scheduler

    from ascend_rl_plugins.devtools import tiny_qwen3
    from ascend_rl_plugins.features.rollout_rebalance import kv_migration as km

    preempted: set = set()

    def recording(wrapped, instance, args, kwargs):
        request = args[0] if args else kwargs["request"]
        params = km.MigrationParams.of(request.kv_transfer_params)
        preempted.add(params.export_key if params is not None else None)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(Scheduler, "_preempt_request", recording)
    llm = LLM(model=tiny_qwen3.cached(), enforce_eager=True, max_model_len=512, max_num_seqs=8,
              dtype="float32", seed=0, num_gpu_blocks_override=11, enable_prefix_caching=False,
              kv_transfer_config=KVTransferConfig(**km.kv_transfer_config(store_dir)))
    prompts = [{"prompt_token_ids": [(7 * i + j) % 900 + 5 for j in range(24 + 3 * i)]}
               for i in range(len(LENGTHS))]
    keys = [f"hop{i}" for i in range(len(LENGTHS))]
    asked = keys[::2]

    def params(i: int, migration: bool) -> SamplingParams:
        extra = {"kv_transfer_params": km.MigrationParams(
            export_key=keys[i], mark_preempted=keys[i] in asked).as_kv_transfer_params()} if migration else None
        return SamplingParams(temperature=0, max_tokens=LENGTHS[i], ignore_eos=True, extra_args=extra)

    outs = llm.generate(prompts, [params(i, True) for i in range(len(LENGTHS))], use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    store = km.KVExportStore(store_dir)
    marked = sorted(store.preempted_keys())
    plain = llm.generate(prompts, [params(i, False) for i in range(len(LENGTHS))], use_tqdm=False)
    return PreemptionMarks(asked=asked, preempted=sorted(k for k in preempted if k), marked=marked,
                           exports=store.keys(), lengths=[len(t) for t in tokens],
                           tokens_match_unmarked_run=tokens == [list(o.outputs[0].token_ids) for o in plain])
