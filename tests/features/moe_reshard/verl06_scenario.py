"""verl 0.6.1's ``per_tensor_generator``, stock vs patched, on a real Megatron-Core MoE model on
gloo (run on every rank by test_hooks.py; never imported by the pytest process).

Real: Megatron-Core's GPTModel with SequentialMLP (then GroupedMLP) experts from the CPU harness
(TP2 x EP2 with ETP = TP = 2 over 4 processes, 4 experts, 2 layers), verl 0.6.1's ``per_tensor_generator`` and its
``McoreToHFWeightConverterQwen3Moe``, this feature's patch applied by ``activate()``, the real
planner and executor. Adapted: verl 0.6.1 runs TransformerEngine layer specs, where the experts
are ``TEGroupedMLP`` (``linear_fc1.weight{i}``, the same per-expert ``[2I/etp, H]`` /
``[H, I/etp]`` tensors as SequentialMLP's) and the input norm is fused into ``linear_qkv``;
TransformerEngine is CUDA-only, so :class:`TESpecNames` presents the harness model's own
parameters under those names (no tensor is copied or changed). Given: the rollout layout
(``declare_rollout``: vLLM's round-robin placement over the 4 ranks, one expert each, assembled
from the two ETP halves its training EP rank group holds), since there is no vLLM engine in these processes; the engine test covers
reading it from a live vLLM model.
"""

from __future__ import annotations

import re

_SEQ = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")


_PARTITION_DIMS = {"linear_qkv.weight": 0, "linear_proj.weight": 1, "word_embeddings.weight": 0,
                   "output_layer.weight": 0, "linear_fc1.weight": 0, "linear_fc2.weight": 1}


class TESpecNames:
    """A Megatron model chunk seen under TransformerEngine spec parameter names.

    The harness loads its canonical weights instead of letting Megatron initialize them, and
    Megatron sets the tensor-parallel attributes (``tensor_model_parallel``, ``partition_dim``,
    which verl's generator reads) in its initializers; they are set here as those would."""

    def __init__(self, module):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        self.module = module
        for name, param in module.named_parameters():
            dim = next((d for suffix, d in _PARTITION_DIMS.items() if name.endswith(suffix)), None)
            if dim is not None and not getattr(param, "tensor_model_parallel", False):
                set_tensor_model_parallel_attributes(param, True, dim, 1)

    @staticmethod
    def rename(name: str) -> str:
        m = _SEQ.match(name)
        if m:
            return f"{m.group(1)}{m.group(3)}.weight{m.group(2)}"
        return name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")

    def named_parameters(self, *args, **kwargs):
        return ((self.rename(n), p) for n, p in self.module.named_parameters(*args, **kwargs))

    def parameters(self):
        return self.module.parameters()

    def state_dict(self, *args, **kwargs):
        return {self.rename(n): t for n, t in self.module.state_dict(*args, **kwargs).items()}


def _hf_config(arch):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=arch.vocab, hidden_size=arch.hidden, num_hidden_layers=arch.layers,
                          num_attention_heads=arch.heads, num_key_value_heads=arch.query_groups,
                          head_dim=arch.kv_channels, num_experts=arch.experts, num_experts_per_tok=arch.topk,
                          moe_intermediate_size=arch.moe_ffn_hidden, tie_word_embeddings=False)


def _collect(gen) -> list:
    return [(name, t.detach().clone()) for name, t in gen]


def stock_vs_patched(tp: int = 1) -> dict:
    import logging

    import torch
    import torch.distributed as dist

    from tests.support.megatron import megatron_model

    rank, world = dist.get_rank(), dist.get_world_size()
    with megatron_model(tp=tp, ep=world // tp, moe="sequential", layers=2, experts=4) as h:
        import verl.utils.megatron_utils as mu
        from verl.models.mcore.weight_converter import McoreToHFWeightConverterQwen3Moe

        import ascend_rl_plugins
        from ascend_rl_plugins.features.moe_reshard import hooks_verl06
        from ascend_rl_plugins.features.moe_reshard.layout import RolloutLayout, parse_hf_expert_name
        from ascend_rl_plugins.patching.core import REGISTRY

        hf = _hf_config(h.arch)
        args = ([TESpecNames(h.model)], hf, McoreToHFWeightConverterQwen3Moe(hf, h.config), h.config,
                {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."})
        out: dict = {"rank": rank}
        stock_fn = mu.per_tensor_generator
        stock = _collect(stock_fn(*args))

        ascend_rl_plugins.activate()
        out["patch_state"] = REGISTRY.patches["moe_reshard.per_tensor_generator"].outcome.state
        out["rebound"] = mu.per_tensor_generator is not stock_fn
        rollout = RolloutLayout.round_robin(tp=1, dp=world, num_experts=h.arch.experts)
        with hooks_verl06.declare_rollout(rollout):
            patched = _collect(mu.per_tensor_generator(*args))

        def split(items):
            dense = [(n, t) for n, t in items if parse_hf_expert_name(n) is None]
            experts = [(n, t) for n, t in items if parse_hf_expert_name(n) is not None]
            return dense, experts

        sd, se = split(stock)
        pd, pe = split(patched)
        stock_experts = dict(se)
        out["stock_dense_names"] = [n for n, _ in sd]
        out["patched_dense_names"] = [n for n, _ in pd]
        out["dense_bit_identical"] = len(sd) == len(pd) and all(
            a[0] == b[0] and a[1].dtype == b[1].dtype and torch.equal(a[1], b[1]) for a, b in zip(sd, pd))
        out["stock_expert_ids"] = sorted({parse_hf_expert_name(n)[1] for n, _ in se})
        out["stock_expert_names"] = len(se)
        out["patched_expert_names"] = [n for n, _ in pe]
        out["hosted"] = list(rollout.expert_maps[rank])
        out["experts_equal_stock"] = all(n in stock_experts and torch.equal(t, stock_experts[n]) for n, t in pe)
        out["expert_bytes"] = {"stock": sum(t.numel() * t.element_size() for _, t in se),
                               "patched": sum(t.numel() * t.element_size() for _, t in pe)}

        # a layout the planner refuses: every rank falls back to stock, with a logged reason
        records: list = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        logging.getLogger("ascend_rl_plugins").addHandler(Keep())
        bad = RolloutLayout.from_expert_maps(1, world, [[0]] * world)  # experts 1..3 hosted nowhere
        with hooks_verl06.declare_rollout(bad):
            fallback = _collect(mu.per_tensor_generator(*args))
        out["fallback_equals_stock"] = [n for n, _ in fallback] == [n for n, _ in stock] and all(
            torch.equal(a[1], b[1]) for a, b in zip(fallback, stock))
        out["fallback_log"] = [m for m in records if "moe_reshard" in m]
        # no rollout reachable at all: stock, with a reason
        records.clear()
        none = _collect(mu.per_tensor_generator(*args))
        out["no_rollout_equals_stock"] = [n for n, _ in none] == [n for n, _ in stock]
        out["no_rollout_log"] = [m for m in records if "moe_reshard" in m]
        # only rank 0 can take part: every rank falls back (no partial sync)
        records.clear()
        if rank == 0:
            with hooks_verl06.declare_rollout(rollout):
                mixed = _collect(mu.per_tensor_generator(*args))
        else:
            mixed = _collect(mu.per_tensor_generator(*args))
        out["mixed_equals_stock"] = [n for n, _ in mixed] == [n for n, _ in stock]
        out["mixed_log"] = [m for m in records if "moe_reshard" in m]
    out["grouped"] = grouped_experts(tp)
    return out


def grouped_experts(tp: int = 1) -> dict:
    """Legacy GroupedMLP (``weight1``/``weight2``, the recipe's grouped-GEMM layout): verl 0.6.1's
    converter has no name for them (the recipe's verl 0006), so stock cannot sync such a model;
    patched, each rank gets exactly its hosted experts, equal to the canonical HF tensors."""
    import torch
    import torch.distributed as dist

    from tests.support.megatron import canonical_weights, megatron_model

    rank, world = dist.get_rank(), dist.get_world_size()
    with megatron_model(tp=tp, ep=world // tp, moe="grouped", layers=2, experts=4, seed=3) as h:
        import verl.utils.megatron_utils as mu
        from verl.models.mcore.weight_converter import McoreToHFWeightConverterQwen3Moe

        from ascend_rl_plugins.features.moe_reshard import hooks_verl06
        from ascend_rl_plugins.features.moe_reshard.layout import RolloutLayout, parse_hf_expert_name

        hf = _hf_config(h.arch)
        args = ([TESpecNames(h.model)], hf, McoreToHFWeightConverterQwen3Moe(hf, h.config), h.config,
                {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."})
        canonical = canonical_weights(h.arch, 3)
        rollout = RolloutLayout.round_robin(tp=1, dp=world, num_experts=h.arch.experts)
        out: dict = {}
        try:  # no rollout declared: the stock path
            _collect(mu.per_tensor_generator(*args))
            out["stock"] = "ok"
        except Exception as exc:  # the reproduction: recorded, the test asserts on it
            out["stock"] = f"{type(exc).__name__}: {exc}"[:300]
        with hooks_verl06.declare_rollout(rollout):
            got = _collect(mu.per_tensor_generator(*args))
        experts = [(n, t) for n, t in got if parse_hf_expert_name(n) is not None]
        out["expert_names"] = sorted(n for n, _ in experts)
        wrong = []
        n = h.arch.moe_ffn_hidden
        for name, t in experts:
            layer, e, proj = parse_hf_expert_name(name)
            p = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}."
            ref = {"gate_proj": canonical[p + "linear_fc1.weight"][:n], "up_proj": canonical[p + "linear_fc1.weight"][n:],
                   "down_proj": canonical[p + "linear_fc2.weight"]}[proj]
            if not torch.equal(t, ref.to(t.dtype)):
                wrong.append(name)
        out["wrong"] = wrong
        out["hosted"] = list(rollout.expert_maps[rank])
        out["dense"] = len(got) - len(experts)
        return out


# -- the whole colocated chain in one process ---------------------------------------------------

CHAIN_PROMPTS = ["def fibonacci(n):", "class Config:"]


def _chain_arch_fields() -> dict:
    # head_dim 32 (vLLM's CPU attention), vocab 512 (the tiny tokenizer's), moe intermediate 32
    return dict(layers=2, experts=4, kv_channels=32, vocab=512)


def hybrid_engine_chain(workdir: str) -> dict:
    """One process, as verl 0.6.1's hybrid engine: a Megatron-Core MoE model (harness, 1 rank) and
    a vLLM 0.13 engine. W0 = the model's weights exported by stock verl, written as an HF
    checkpoint, and the engine started on it; then the model takes other weights (W1) and verl's
    real ``vLLMAsyncRollout.update_weights(per_tensor_generator(...))`` syncs them -- stock (this
    feature's generator patch reverted) and patched (the generator reads the expert map and
    rollout rank from the live vLLM model published by the update_weights patch)."""
    import asyncio
    import json as _json
    import os
    import shutil
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from ascend_rl_plugins.devtools import tiny_qwen3
    from tests.support.megatron import canonical_weights, megatron_model

    import torch.distributed as dist
    out: dict = {}
    with megatron_model(moe="sequential", **_chain_arch_fields()) as h:
        import verl.utils.megatron_utils as mu
        from verl.models.mcore.weight_converter import McoreToHFWeightConverterQwen3Moe

        hf = _hf_config(h.arch)
        args = ([TESpecNames(h.model)], hf, McoreToHFWeightConverterQwen3Moe(hf, h.config), h.config,
                {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."})
        w0 = os.path.join(workdir, "w0")
        os.makedirs(w0, exist_ok=True)
        w0_tensors = {n: t.to(torch.bfloat16).contiguous() for n, t in mu.per_tensor_generator(*args)}
        if dist.get_rank() == 0:
            save_file(w0_tensors, os.path.join(w0, "model.safetensors"))
            hf.architectures = ["Qwen3MoeForCausalLM"]
            hf.torch_dtype = "bfloat16"
            hf.save_pretrained(w0)
            tok = tiny_qwen3.cached(moe=True)
            for f in os.listdir(tok):
                if f.startswith("tokenizer") or f == "special_tokens_map.json":
                    shutil.copy(os.path.join(tok, f), os.path.join(w0, f))
            with open(os.path.join(w0, "generation_config.json"), "w") as fh:
                _json.dump({"eos_token_id": 0, "do_sample": False}, fh)
        dist.barrier()

        from vllm import LLM, SamplingParams
        # one rank: vLLM 0.13's CPU platform runs its own worker processes for tp > 1 instead of
        # joining the caller's ranks (verl's external_launcher), so the multi-rank chain is not run here
        llm = LLM(model=w0, enforce_eager=True, max_model_len=128, max_num_seqs=2, dtype="bfloat16", seed=0,
                  gpu_memory_utilization=0.5)
        engine = llm.llm_engine
        executor = getattr(engine, "model_executor", None) or engine.engine_core.engine_core.model_executor
        runner = executor.driver_worker.worker.model_runner
        sp = SamplingParams(max_tokens=8, temperature=0.0)

        def generate():
            return [list(o.outputs[0].token_ids) for o in llm.generate(CHAIN_PROMPTS, sp, use_tqdm=False)]

        def state():
            return {n: p.detach().clone() for n, p in runner.model.named_parameters()}

        out["w0_tokens"] = generate()
        from ascend_rl_plugins.features.moe_reshard import vllm_side
        out["expert_map"] = list(vllm_side.local_expert_map(runner.model))
        h.load(canonical_weights(h.arch, 1))  # a "training step": other weights
        import ascend_rl_plugins
        from ascend_rl_plugins.features.moe_reshard import hooks_verl06
        from ascend_rl_plugins.patching.core import REGISTRY
        from verl.workers.rollout.vllm_rollout.vllm_rollout_spmd import vLLMAsyncRollout

        ascend_rl_plugins.activate()
        gen_patch = REGISTRY.patches["moe_reshard.per_tensor_generator"]
        out["states"] = {p.name: p.outcome.state for p in REGISTRY.features["moe_reshard"].patches
                         if p.versions_text == ">=0.6,<0.7"}   # verl 0.6.1's hooks (the 0.9 one is skipped here)
        rollout = vLLMAsyncRollout.__new__(vLLMAsyncRollout)
        rollout.inference_engine = SimpleNamespace(worker=SimpleNamespace(model_runner=runner))

        seen: list = []
        real_generate = hooks_verl06._generate

        def spy(wrapped, a):  # runs when vLLM's load_weights pulls the first tensor
            seen.append(hooks_verl06.LIVE.model is runner.model)
            yield from real_generate(wrapped, a)

        hooks_verl06._generate = spy
        REGISTRY.revert(gen_patch)
        asyncio.run(vLLMAsyncRollout.update_weights(rollout, mu.per_tensor_generator(*args)))
        out["stock_tokens"], stock_state = generate(), state()
        REGISTRY.apply(gen_patch)
        asyncio.run(vLLMAsyncRollout.update_weights(rollout, mu.per_tensor_generator(*args)))
        out["patched_tokens"], patched_state = generate(), state()
        out["generator_saw_live_model"] = seen
        out["different"] = sorted(n for n in stock_state if not torch.equal(stock_state[n], patched_state[n]))
        out["params"] = len(stock_state)
        return out


# -- one rank refuses, the others could go ahead -----------------------------------------------

REFUSALS = ("validation", "planner", "exception", "setup_exception", "digest")


def _refuse_on_one_rank(case: str, rank: int, stack):
    """Make exactly one rank (``REFUSING[case]``) refuse, for the reason ``case`` names; the
    others see nothing wrong. Fault injection on the real modules, undone by ``stack``."""
    import os

    from ascend_rl_plugins import flags
    from ascend_rl_plugins.features.moe_reshard import hooks_verl06, planner

    if rank != REFUSING[case]:
        return

    def patch(obj, name, value):
        old = getattr(obj, name)
        setattr(obj, name, value)
        stack.callback(setattr, obj, name, old)

    if case == "validation":      # the plan this rank made fails its own check
        def validate(self):
            raise planner.PlanError(f"rank {rank} receives 1 bytes, minimum 0 (injected)")
        patch(planner.Plan, "validate", validate)
    elif case == "planner":       # the planner refuses this rank's inputs
        def refuse(*args, **kwargs):
            raise planner.PlanError("moe ffn hidden 8 is not divisible by etp 3 (injected)")
        patch(planner, "plan", refuse)
    elif case == "exception":     # something unexpected raises while this rank prepares its plan
        def broken(*args, **kwargs):
            raise RuntimeError("expert parameters unreadable (injected)")
        patch(hooks_verl06, "local_expert_params", broken)
    elif case == "setup_exception":  # ... or while it reads its layouts
        def broken_setup(*args, **kwargs):
            raise KeyError("num_moe_experts (injected)")
        patch(hooks_verl06, "_setup", broken_setup)
    elif case == "digest":        # a flag set differently on this rank: another plan
        os.environ["ASCEND_RL_MOE_RESHARD_BUCKET_MB"] = "1"
        flags.reset_cache()
        stack.callback(flags.reset_cache)
        stack.callback(os.environ.pop, "ASCEND_RL_MOE_RESHARD_BUCKET_MB")


REFUSING = {"validation": 1, "planner": 2, "exception": 3, "setup_exception": 0, "digest": 1}


def one_rank_refuses(tp: int = 1) -> dict:
    """For each case of :data:`REFUSALS`, exactly one rank refuses while the others could
    reshard (the rollout layout is declared on every rank). Returns, per case, whether this
    rank's sync equals stock's (names and tensors: every rank took the stock path, none
    resharded, nothing is missing) and the log lines it wrote. A rank that kept its refusal to
    itself would leave the others waiting in an all-to-all (the group's timeout) or yield a
    partial set of experts (compared here)."""
    import contextlib
    import logging

    import torch
    import torch.distributed as dist

    from tests.support.megatron import megatron_model

    rank, world = dist.get_rank(), dist.get_world_size()
    with megatron_model(tp=tp, ep=world // tp, moe="sequential", layers=2, experts=4) as h:
        import verl.utils.megatron_utils as mu
        from verl.models.mcore.weight_converter import McoreToHFWeightConverterQwen3Moe

        import ascend_rl_plugins
        from ascend_rl_plugins.features.moe_reshard import hooks_verl06, planner
        from ascend_rl_plugins.features.moe_reshard.layout import RolloutLayout
        from ascend_rl_plugins.patching import fallback

        hf = _hf_config(h.arch)
        args = ([TESpecNames(h.model)], hf, McoreToHFWeightConverterQwen3Moe(hf, h.config), h.config,
                {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."})
        stock = _collect(mu.per_tensor_generator(*args))
        ascend_rl_plugins.activate()
        records: list = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append((record.levelname, record.getMessage()))

        logging.getLogger("ascend_rl_plugins").addHandler(Keep())
        rollout = RolloutLayout.round_robin(tp=1, dp=world, num_experts=h.arch.experts)
        out: dict = {"rank": rank}

        def sync() -> dict:
            got = _collect(mu.per_tensor_generator(*args))
            return {"equals_stock": [n for n, _ in got] == [n for n, _ in stock] and all(
                torch.equal(a[1], b[1]) for a, b in zip(got, stock)), "tensors": len(got)}

        with hooks_verl06.declare_rollout(rollout):
            planner.CACHE.reset()
            out["healthy"] = sync()            # nobody refuses: the reshard runs (fewer tensors)
            for case in REFUSALS:
                records.clear()
                fallback.forget()
                planner.CACHE.reset()
                with contextlib.ExitStack() as stack:
                    _refuse_on_one_rank(case, rank, stack)
                    result = sync()
                result["log"] = [f"{level} {m}" for level, m in records if "moe_reshard" in m]
                out[case] = result
            records.clear()
            planner.CACHE.reset()
            out["after"] = sync()              # the group is still usable and the reshard runs again
        # EPLB moved experts since the last sync (verl #7086: a sync planned from the old map
        # leaves stale experts in the moved slots): the map read at this sync is a new plan key,
        # so the plan is made afresh and each rank receives exactly what it hosts now
        moved = RolloutLayout.from_expert_maps(1, world, [[(r + 1) % world] for r in range(world)])
        with hooks_verl06.declare_rollout(moved):
            got = _collect(mu.per_tensor_generator(*args))
        stock_by_name = dict(stock)
        experts = [(n, t) for n, t in got if ".mlp.experts." in n]
        out["moved"] = {"hosted": list(moved.expert_maps[rank]), "expert_ids": sorted({int(n.split(".")[5]) for n, _ in experts}),
                        "names": len(experts), "equal_stock": all(torch.equal(t, stock_by_name[n]) for n, t in experts),
                        "plans_cached": len(planner.CACHE)}
        out["stock_tensors"] = len(stock)
    return out
