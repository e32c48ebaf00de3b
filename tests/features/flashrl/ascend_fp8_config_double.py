"""Test double: vLLM-Ascend 0.23's ``AscendFp8Config`` (``vllm_ascend/quantization/fp8_config.py``).

Only what ``flashrl.ascend_block_fp8_refusal`` touches: the constructor and the classmethod
``from_config(cls, config)`` with the real signatures (test_block_fp8_serving.py compares them
with the real source by AST) and the real body's effect (ignore list, format, description).
vLLM-Ascend cannot be imported without CANN, so the refusal runs against this double.
"""

from __future__ import annotations

from typing import Any


class AscendFp8ConfigDouble:
    def __init__(self, ignore: list[str], quant_format: str, config: dict[str, Any] | None = None):
        self.ignore = ignore
        self.quant_format = quant_format
        self.quant_description = config if config is not None else {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AscendFp8ConfigDouble":
        return cls(ignore=config.get("ignore", []), quant_format=config.get("format"), config=config)
