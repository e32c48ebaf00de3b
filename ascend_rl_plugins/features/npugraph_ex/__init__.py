"""npugraph_ex static kernel: the Qwen3 RL recipe's attribute-name typo fix is not needed.

vLLM-Ascend 0.13 has no static-kernel batch-size computation and 0.23 reads the correct
attribute names (tests/features/npugraph_ex proves both from the sources on every run), so the
patch is declared with an empty version range: doctor reports it "fixed upstream" and it is
never applied. The replacement is a real implementation, equal to 0.23's function, in case a
fork with the bug has to be supported. README.md beside this file: why, verified where.

Remove when: recipe-era vLLM-Ascend forks are no longer of interest.
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_NPUGRAPH_EX_FIX", "bool", True,
    "Correct static-kernel batch sizes for npugraph_ex. No supported vLLM-Ascend needs it "
    "(0.13 has no such code, 0.23 fixed it): the patch's version range is empty.",
    feature="npugraph_ex")

FEATURE = Feature(
    "npugraph_ex", "npugraph_ex static-kernel typo fix (fixed upstream; never applied).",
    flag=ENABLE,
    replaces="Qwen3 RL recipe vLLM-Ascend patch 0004-vllm_ascend-bugfix-npugraph_ex_static_kernel_typo",
    verified=Verified(cpu_runtime="replacement equal to vLLM-Ascend 0.23's function (compiled from source)",
                      static="AST proof on both vLLM-Ascend sources that the typo is fixed or absent; "
                             "never applied on either stack"),
    stacks="none needs it")

NO_SUPPORTED_VERSION = ">=0.13,<0.13"  # empty on purpose


def decode_graph_batch_sizes(vllm_config) -> list[int]:
    """Graph capture sizes that a uniform decode batch can take: multiples of the query
    length per request (1 + speculative tokens) up to ``max_num_seqs`` requests."""
    spec = vllm_config.speculative_config
    query_len = 1 + (spec.num_speculative_tokens if spec else 0)
    max_tokens = vllm_config.scheduler_config.max_num_seqs * query_len
    return [size for size in vllm_config.compilation_config.cudagraph_capture_sizes
            if query_len <= size <= max_tokens]


FEATURE.replace(
    "vllm_ascend.compilation.compiler_interface:_compute_decode_cudagraph_batch_sizes",
    decode_graph_batch_sizes, dist="vllm-ascend", versions=NO_SUPPORTED_VERSION,
    name="npugraph_ex.decode_graph_batch_sizes",
    fixed_upstream="vllm-ascend 0.23 (_compute_decode_cudagraph_batch_sizes uses the correct "
                   "attribute names); 0.13 has no static-kernel batch-size computation",
    reason="the recipe's vLLM-Ascend fork read misspelt config attributes when sizing static kernels",
    replaces="recipe vLLM-Ascend patch 0004",
    remove_when="recipe-era vLLM-Ascend forks are no longer supported")
