"""The quantization library below the features: the formats (INT8 and FP8 rows or tensor, INT4
groups in both presets, block FP8), their CPU kernels (numba), device-exact division, the
compiled device paths with their first-use verification, and the bit-identity helpers the
device self-tests share.

Why a package of its own: the rollout reload (``features/flashrl``), INT4 QAT
(``features/int4_qat``) and ``ascend-rl selftest`` use the same quantizers (the rollout mismatch
metric measures what they change), and a feature must not import another feature's modules.
Nothing here knows about vLLM or verl; torch, numpy and numba are imported by the submodules
that compute, never by this package itself, so importing the plugin stays cheap.

Modules: :mod:`.formats` (constants, INT4 spec and checks), :mod:`.quant` (INT8 / FP8 rows),
:mod:`.int4` (INT4 groups), :mod:`.block_fp8`, :mod:`.device_math` (division by device
tensors, non-finite refusal, block sizes), :mod:`.fused` (compiled forms and their
verification), :mod:`._cpu_kernels` / :mod:`._int4_kernels` (numba), :mod:`.baselines` (the
formulas they replace, for benchmarks and the self-test), :mod:`.identity` (bit-identity rows).
"""
