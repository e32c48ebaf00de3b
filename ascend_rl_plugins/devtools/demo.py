"""CPU demo: ascend-rl patches at work inside a real vLLM engine, no accelerator needed.

    python -m ascend_rl_plugins.devtools.demo

Builds the tiny random Qwen3 (locally, no download), then runs the same greedy batch twice
(run by ``.ci/main`` on the current stack, vLLM 0.23; on vLLM 0.13 it needs the
``cpu_rms_norm`` patch, on by default), each engine in its own process: once on stock vLLM, once with ascend-rl's gc-off decode
and SAM speculative decoding switched on. It prints what the engine-core process reported
about the plugin (diagnostics), the outputs' agreement, and the drafter's acceptance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2,
    "import os\nimport sys\nimport json\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
]

_ENGINE = r"""
import json, os, sys, time
from vllm import LLM, SamplingParams
model, spec, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
kwargs = dict(model=model, enforce_eager=True, max_model_len=1024, max_num_seqs=16, seed=0,
              disable_log_stats=False)
if spec:
    kwargs["speculative_config"] = spec
llm = LLM(**kwargs)
prompts = json.loads(os.environ["DEMO_PROMPTS"])
t = time.perf_counter()
outs = llm.generate(prompts * n, SamplingParams(max_tokens=96, temperature=0))
elapsed = time.perf_counter() - t
metrics = {}
try:
    for m in llm.get_metrics():
        if "spec_decode" in m.name and hasattr(m, "value"):
            metrics[m.name] = m.value
except Exception as exc:  # metrics API differs across versions; the demo does not depend on it
    metrics["unavailable"] = str(exc)
print("@@DEMO@@" + json.dumps({"tokens": [[list(c.token_ids) for c in o.outputs] for o in outs],
                               "seconds": elapsed, "metrics": metrics}))
"""


def _run(model: str, spec: dict | None, env_extra: dict[str, str], n: int = 1) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false",
               DEMO_PROMPTS=json.dumps(PROMPTS), **env_extra)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write("if __name__ == '__main__':\n" + textwrap.indent(_ENGINE, "    "))
        script = fh.name
    try:
        proc = subprocess.run([sys.executable, script, model, json.dumps(spec), str(n)], env=env,
                              capture_output=True, text=True, timeout=1200)
    finally:
        os.unlink(script)
    for line in proc.stdout.splitlines():
        if line.startswith("@@DEMO@@"):
            return json.loads(line[len("@@DEMO@@"):])
    raise SystemExit(f"demo engine failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def drafting(metrics: dict) -> tuple[str, bool]:
    """(one line on what SAM drafted, whether it drafted at all), from vLLM's own
    speculative-decoding counters. The SAM proposer runs in the worker process, which the
    diagnostics table (the engine-core process) does not list, so this is the evidence that
    it ran."""
    drafts = metrics.get("vllm:spec_decode_num_drafts")
    proposed = metrics.get("vllm:spec_decode_num_draft_tokens")
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens")
    if drafts is None or proposed is None or accepted is None:
        return ("SAM drafting: vLLM's speculative-decoding counters are unavailable here "
                f"({json.dumps(metrics)})"), True
    rate = f"{accepted / proposed:.0%}" if proposed else "-"
    return (f"SAM drafted {int(proposed)} tokens in {int(drafts)} drafts; the model accepted "
            f"{int(accepted)} ({rate}) -- vLLM's own spec-decode counters"), drafts > 0


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    from . import tiny_qwen3

    console = Console(width=160)
    model = tiny_qwen3.cached()
    console.print(f"tiny Qwen3 (random weights, local BPE tokenizer): {model}")
    diag = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False).name
    spec = {"method": "sam", "num_speculative_tokens": 3}
    flags_on = {"ASCEND_RL_GC_OFF": "1", "ASCEND_RL_DIAGNOSTICS": diag, "ASCEND_RL_SAM": "1",
                "ASCEND_RL_CPU_SPEC_DECODE": "1"}
    console.print("engine 1: stock vLLM (ascend-rl flags off) ...")
    base = _run(model, None, {"ASCEND_RL_DISABLE": "all"}, n=2)
    console.print(f"engine 2: ascend-rl on ({', '.join(f'{k}={v}' for k, v in flags_on.items())}), "
                  f"speculative_config={spec} ...")
    ours = _run(model, spec, flags_on, n=2)

    records = [json.loads(line) for line in open(diag)]
    os.unlink(diag)
    table = Table(title="patches inside the engine-core process (ASCEND_RL_DIAGNOSTICS)")
    for col in ("pid", "activated by", "patch", "state", "reason"):
        table.add_column(col, overflow="fold")
    for rec in records:
        for p in rec["patches"]:
            if p["state"] in ("applied", "failed"):
                table.add_row(str(rec["pid"]), rec["activated_by"][0], p["patch"], p["state"], p["reason"])
    console.print(table)
    same = base["tokens"] == ours["tokens"]
    total = sum(len(c) for o in ours["tokens"] for c in o)
    console.print(f"greedy outputs identical with and without ascend-rl: [bold]{same}[/bold] "
                  f"({len(PROMPTS)} prompts, each sent twice (siblings share a SAM group), "
                  f"{total} generated tokens)")
    console.print(f"wall time of generate(): stock {base['seconds']:.2f} s, ascend-rl {ours['seconds']:.2f} s "
                  f"(tiny random model on CPU: not a speed benchmark)")
    line, drafted = drafting(ours["metrics"])
    console.print(line, highlight=False)
    if not drafted:
        console.print("[red]SAM did not draft a single token[/red]: speculative decoding was not in effect")
    return 0 if same and drafted else 1


if __name__ == "__main__":
    sys.exit(main())
