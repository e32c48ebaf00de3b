"""vLLM 0.23 on a CPU without its fused-MoE kernel (AVX2-only x86): every MoE forward crashes.

``CPUFusedMOE`` falls back to its torch path (``cpu_fused_moe_torch``) when the loaded kernel
library has no ``prepack_moe_weight`` (vLLM's AVX2 library) or AMX cannot take the shapes; that
path looks the activation up in ``cpu_fused_moe._CPU_MOE_ACT_FN``, whose SiLU entry constructs a
``SiluAndMul`` -- a ``CustomOp``, whose constructor asserts that a vLLM config is current -- on
every call, inside the model forward, where none is. The engine dies in its warm-up with
``AssertionError: Current vLLM config is not set``. The table is replaced by one whose SiLU entry
is ``SiluAndMul``'s static torch implementation (nothing constructed, the same arithmetic); every
other entry is vLLM's own. README.md beside this file: why, flags, verified where.

Remove when: vLLM's SiLU entry stops constructing the op (vllm-project/vllm#45480).

This module only declares; vLLM is imported when the patched table is first looked up.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_CPU_FUSED_MOE_FALLBACK_FIX", "bool", True,
    "vLLM 0.23 on CPU: the fused-MoE torch fallback (taken on AVX2-only CPUs, whose vLLM kernel "
    "library has no MoE prepack) uses SiluAndMul's static torch function instead of building a "
    "SiluAndMul op in every forward (which fails: 'Current vLLM config is not set'). Changes only "
    "vLLM's CPU MoE activation table.",
    feature="cpu_fused_moe_fallback")

FEATURE = Feature(
    "cpu_fused_moe_fallback",
    "vLLM 0.23's CPU fused-MoE torch fallback (AVX2-only CPUs) runs instead of failing in every forward.",
    flag=ENABLE, replaces="(found here; not in the Qwen3 RL recipe)",
    verified=Verified(
        cpu_runtime="a real vLLM 0.23 engine on a tiny Qwen3-MoE forced onto the torch fallback (vLLM's "
                    "own AVX2 kernel library): fails unpatched, agrees with Hugging Face transformers "
                    "patched; the table's entries against vLLM's"),
    stacks="current")

TARGET = "vllm.model_executor.layers.fused_moe.cpu_fused_moe:_CPU_MOE_ACT_FN"


def table_with_static_silu(upstream: Mapping) -> dict:
    """``upstream`` (vLLM's activation table) with its SiLU entry replaced by
    ``SiluAndMul.forward_native``, a static method: calling it constructs no ``CustomOp``, so it
    needs no current vLLM config; the arithmetic is the one the replaced entry ran."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    table = dict(upstream)
    table[MoEActivation.SILU] = SiluAndMul.forward_native
    return table


class StaticSiluActivationTable(Mapping):
    """Installed as ``cpu_fused_moe._CPU_MOE_ACT_FN``: vLLM's own table (the patch's pristine
    original) with the SiLU entry of :func:`table_with_static_silu`, built on the first lookup
    (declaring the patch imports nothing; looking up is one dict access afterwards)."""

    def __init__(self) -> None:
        self._table: dict | None = None

    def _resolved(self) -> dict:
        if self._table is None:
            self._table = table_with_static_silu(ACTIVATION_TABLE.original)
        return self._table

    def __getitem__(self, activation: Any) -> Any:
        return self._resolved()[activation]

    def __iter__(self) -> Iterator:
        return iter(self._resolved())

    def __len__(self) -> int:
        return len(self._resolved())


ACTIVATION_TABLE = FEATURE.set(
    TARGET, StaticSiluActivationTable(), name="cpu_fused_moe_fallback.static_silu_activation",
    dist="vllm", versions=">=0.23,<0.24",
    reason="vLLM 0.23's CPU fused-MoE torch fallback (cpu_fused_moe_torch, taken when the kernel "
           "library has no prepack_moe_weight, e.g. on AVX2-only x86) builds a SiluAndMul CustomOp "
           "inside the forward, outside any vLLM config context: every MoE model fails with "
           "'Current vLLM config is not set'",
    remove_when="vLLM's _CPU_MOE_ACT_FN SiLU entry no longer constructs SiluAndMul "
                "(vllm-project/vllm#45480; vLLM 0.23.0 still does)",
    upstream="https://github.com/vllm-project/vllm/issues/45447 (fix: "
             "https://github.com/vllm-project/vllm/pull/45480)")
