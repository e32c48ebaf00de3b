"""vLLM 0.13's CPU RMSNorm on a strided view (Qwen3's q/k norm): wrong without the patch,
right with it; and a real vLLM 0.13 engine then agrees with Hugging Face transformers."""

from __future__ import annotations

import pytest

from helpers import ENGINE_ENV, run_python, stack_name, vllm_version

pytestmark = pytest.mark.skipif(stack_name() != "recipe",
                                reason="the patch targets vLLM 0.13 (the recipe stack)")

KERNEL = r"""
import os, torch
from ascend_rl_plugins import plugin
if os.environ["PATCHED"] == "1":
    plugin.activate("test")
from vllm.model_executor.layers import layernorm
torch.manual_seed(0)
qkv = torch.randn(7, 4 * 64)
q = qkv[:, : 2 * 64].view(7, 2, 64)  # as Qwen3's attention normalizes q per head
w = torch.randn(64)
ref = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * w
got = layernorm.rms_norm(q, w, 1e-6)
emit(float((got - ref).abs().max()))
"""


@pytest.mark.parametrize("patched", [False, True])
def test_strided_input(patched):
    err = run_python(KERNEL, env={"PATCHED": "1" if patched else "0", "ASCEND_RL_AUTOLOAD": "0"})
    if patched:
        assert err < 1e-5
    else:  # the upstream bug this patch exists for; if this passes, the patch can go
        assert err > 1e-2


ENGINE = r"""
import torch
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams
from ascend_rl_plugins.devtools import tiny_qwen3
PROMPTS = [([5, 6, 7, 8, 9] * 8)[:40], list(range(10, 50)), ([300, 301, 302, 303] * 10)[:38]]
path = tiny_qwen3.cached()
hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
want = [int(hf(torch.tensor([p])).logits[0, -1].argmax()) for p in PROMPTS]
llm = LLM(model=path, enforce_eager=True, max_model_len=256, max_num_seqs=4, dtype="float32", seed=0)
outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                    SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
emit({"hf": want, "vllm": [o.outputs[0].token_ids[0] for o in outs]})
"""


def test_engine_agrees_with_transformers():
    res = run_python(ENGINE, env=dict(ENGINE_ENV), timeout=900)
    assert res["vllm"] == res["hf"]
