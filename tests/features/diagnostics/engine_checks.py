"""diagnostics' check on the shared engines (see tests/features/shared_engine.py): what the
engine's process(es) wrote to the report file after several more engine steps."""

from __future__ import annotations

import json
import os

ENV = MULTIPROCESS_ENV = {"ASCEND_RL_DIAGNOSTICS": "{workdir}/diagnostics.jsonl"}


def records(ctx) -> dict:
    from vllm import SamplingParams
    ctx.llm.generate([{"prompt_token_ids": [3, 4, 5]}] * 2, SamplingParams(max_tokens=3), use_tqdm=False)
    with open(os.environ["ASCEND_RL_DIAGNOSTICS"], encoding="utf-8") as fh:
        return {"records": [json.loads(line) for line in fh]}
