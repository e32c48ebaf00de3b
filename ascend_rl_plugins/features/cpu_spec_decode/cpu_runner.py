"""CPU speculative decoding pieces that need vLLM/torch (imported lazily by the patches).

* vLLM 0.13: ``CPUModelRunner.__init__`` without its ``assert speculative_config is None``
  (the rest is what 0.13's constructor does: build the GPU runner state under the CPU
  ``torch.cuda`` shim, then alias device buffers to their CPU twins).
* vLLM 0.23: the CPU recovered-token kernel, accepting the sampler's fp64 Gumbel noise.
Remove when running vLLM >= 0.23 (first item) / when the 0.23 shim takes USE_FP64_GUMBEL.
"""

from __future__ import annotations

import torch


def cpu_runner_init(runner, vllm_config, device) -> None:
    from vllm.v1.worker import cpu_model_runner as cmr
    with cmr._torch_cuda_wrapper():
        super(cmr.CPUModelRunner, runner).__init__(vllm_config, device)
    if device != torch.device("cpu"):
        raise ValueError(f"CPUModelRunner needs device 'cpu', got {device}")
    runner.use_cuda_graph = False
    runner.cascade_attn_enabled = False
    runner._postprocess_tensors()


def sample_recovered_tokens_cpu(output_token_ids, cu_num_draft_tokens, draft_token_ids,
                                draft_probs, target_probs, inv_q, vocab_size, *rest, **kwargs):
    """vLLM 0.23's CPU kernel, fed float32 noise (the C++ kernel reads float32) when the
    sampler drew fp64 Gumbel noise."""
    from vllm.utils import cpu_triton_utils
    if inv_q.dtype != torch.float32:
        inv_q = inv_q.to(torch.float32)
    return cpu_triton_utils._sample_recovered_tokens_kernel_impl(
        output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
        inv_q, vocab_size, *rest, **kwargs)
