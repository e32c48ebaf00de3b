"""Speculative decoding on a CPU host, with stock vLLM.

Why: nothing here matters on an NPU; it makes vLLM's speculative decoding (any method, SAM
included) run on CPU, for CPU users and for this project's own end-to-end tests.
* vLLM 0.13's ``CPUModelRunner.__init__`` asserts ``speculative_config is None``; the
  constructor is replaced by the same steps without the assert.
* vLLM 0.13's rejection sampler launches Triton kernels, which do not run on a CPU-only
  host; CPU tensors go to a vectorized PyTorch implementation (``rejection.py``).
* Per-request top-k/top-p/temperature expansion: Triton-only in 0.13; in 0.23 the CPU shim
  writes into an int64 copy of an int32 output and drops it.
* vLLM 0.23's rejection sampler passes ``USE_FP64_GUMBEL`` to the CPU recovered-token
  kernel shim, which does not take it: random-sampling spec decode raises TypeError.

Remove when: running vLLM >= 0.23 (first two items) and the 0.23 CPU shims are fixed
upstream (last two items: the fp64-Gumbel one is merged after 0.23.0, the expand one is an
open pull request). README.md beside this file: why, flags, verified where.

This module only declares flags and patches; torch/vLLM are imported by the submodules,
lazily, when a patched function first runs.
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_CPU_SPEC_DECODE", "bool", True,
    "Make vLLM speculative decoding run on CPU: lift vLLM 0.13's CPU-runner refusal with a "
    "vectorized PyTorch rejection sampler, and fix vLLM 0.23's CPU expand and recovered-token "
    "kernel shims. Acts only on CPU tensors / the CPU runner; nothing changes on an NPU.",
    feature="cpu_spec_decode")
FEATURE = Feature("cpu_spec_decode", "speculative decoding on a CPU host with stock vLLM",
                  flag=ENABLE, replaces="none (needed to run speculative decoding on CPU)",
                  verified=Verified(cpu_runtime="vLLM's own rejection sampler and top-k expansion on CPU "
                                                "tensors, with and without the patches; real "
                                                "speculative engines (SAM's tests) on 0.13 and 0.23"),
                  stacks="recipe, current")


@FEATURE.replace("vllm.v1.worker.cpu_model_runner:CPUModelRunner.__init__", name="cpu_spec_decode.cpu_runner_allows_spec_decode", dist="vllm",
                 versions=">=0.13,<0.14", params=("self", "vllm_config", "device"),
                 fixed_upstream="vLLM 0.23 (CPU runner supports speculative decoding)",
                 reason="vLLM 0.13's CPU runner asserts speculative_config is None",
                 remove_when="running vLLM >= the release that supports CPU spec decode (0.23 does)")
def _cpu_runner_init(self, vllm_config, device):
    from .cpu_runner import cpu_runner_init
    cpu_runner_init(self, vllm_config, device)


@FEATURE.wrap("vllm.v1.sample.rejection_sampler:rejection_sample", name="cpu_spec_decode.pytorch_rejection_sampler", dist="vllm",
              versions=">=0.13,<0.14", order=20,
              fixed_upstream="vLLM 0.23 (CPU kernels for the rejection sampler)",
              reason="vLLM 0.13's rejection sampler launches Triton kernels; on CPU tensors use "
                     "the vectorized PyTorch implementation",
              remove_when="running vLLM >= 0.23 on CPU")
def _rejection_sample_cpu(wrapped, instance, args, kwargs):
    target_probs = args[5] if len(args) > 5 else kwargs["target_probs"]
    if target_probs.device.type != "cpu":
        return wrapped(*args, **kwargs)
    from . import rejection
    names = ("draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens",
             "draft_probs", "target_probs", "bonus_token_ids", "sampling_metadata")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    from vllm.v1.sample import rejection_sampler as upstream
    return rejection.rejection_sample(**bound, uniform_probs_fn=upstream.generate_uniform_probs)


@FEATURE.wrap("vllm.v1.sample.rejection_sampler:expand_batch_to_tokens", name="cpu_spec_decode.cpu_expand_batch_to_tokens", dist="vllm",
              versions=">=0.13,<0.24", order=20,
              reason="per-request top-k/top-p/temperature expansion for non-greedy spec decode: "
                     "Triton-only in vLLM 0.13; in 0.23 the CPU shim writes into an int64 copy of "
                     "an int32 output and drops it, so top-k gets garbage ('selected index k out "
                     "of range')",
              remove_when="the CPU expand kernel shim writes the caller's dtype (and vLLM >= 0.23)",
              upstream="https://github.com/vllm-project/vllm/pull/55006")
def _expand_batch_cpu(wrapped, instance, args, kwargs):
    x = args[0] if args else kwargs["x"]
    if x.device.type != "cpu":
        return wrapped(*args, **kwargs)
    from .rejection import expand_batch_to_tokens
    return expand_batch_to_tokens(*args, **kwargs)


class _RecoveredTokensLauncher:
    """Stands in for vLLM 0.23's ``cpu_triton_utils.sample_recovered_tokens_kernel``
    (``kernel[grid](...)``), accepting the ``USE_FP64_GUMBEL`` argument the sampler passes."""

    def __getitem__(self, grid):
        return _launch_recovered_tokens


def _launch_recovered_tokens(*args, USE_FP64_GUMBEL=False, **kwargs):
    from .cpu_runner import sample_recovered_tokens_cpu
    return sample_recovered_tokens_cpu(*args, **kwargs)


FEATURE.set("vllm.utils.cpu_triton_utils:sample_recovered_tokens_kernel", _RecoveredTokensLauncher(),
            dist="vllm", versions=">=0.23,<0.24",
            name="cpu_spec_decode.recovered_tokens_fp64_gumbel",
            reason="vLLM 0.23's rejection sampler passes USE_FP64_GUMBEL to the recovered-token "
                   "kernel; the CPU shim does not take it, so random-sampling spec decode on CPU "
                   "raises TypeError",
            remove_when="vllm.utils.cpu_triton_utils._sample_recovered_tokens_kernel_impl accepts "
                        "USE_FP64_GUMBEL (merged upstream after vLLM 0.23.0)",
            upstream="https://github.com/vllm-project/vllm/pull/46069")


