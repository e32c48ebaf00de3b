"""npugraph_ex static kernel: the seed's attribute-name typo fix is not needed any more.

Why it existed: seed 003's vLLM-Ascend patch 0004 fixed a fork of vLLM-Ascend whose
npugraph_ex backend computed the batch sizes for static-kernel compilation from
misspelt config attributes (``num_speculative_token``, ``max_num_seq``,
``cudagraph_capture_size``), so enabling the static kernel failed.

What the supported releases do (read in their sources; tests/engine_patches/test_npugraph_ex.py
proves it on every run):
- vLLM-Ascend 0.13.0: the buggy code is absent. ``npugraph_ex_compile`` only switches the
  static-shape kernel on; there is no batch-size range to compute.
- vLLM-Ascend 0.23.0: fixed. ``_compute_decode_cudagraph_batch_sizes`` reads
  ``speculative_config.num_speculative_tokens``, ``scheduler_config.max_num_seqs`` and
  ``compilation_config.cudagraph_capture_sizes``.

So the patch is declared with an empty version range: ``doctor`` reports it "fixed
upstream" and it is never applied. Its replacement is a real implementation (equivalent to
0.23's, checked by the test) in case a fork with the bug has to be supported; widening the
range is all that would take. Remove when: seed-era forks are no longer of interest.
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
    flag=ENABLE, replaces="seed 003 vLLM-Ascend 0004-vllm_ascend-bugfix-npugraph_ex_static_kernel_typo",
    verified=Verified(static="AST proof on both vLLM-Ascend sources that the typo is fixed; "
                                       "replacement checked equal to the 0.23 function"),
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
    reason="seed fork read misspelt config attributes when sizing static kernels",
    replaces="seed vLLM-Ascend 0004",
    remove_when="seed-era vLLM-Ascend forks are no longer supported")
