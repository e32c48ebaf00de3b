"""Launch N copies of a script as a gloo DP group (torchrun-style env) and collect results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

from helpers import MARK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(code: str, world: int, *, env: dict | None = None, timeout: float = 600,
              python: str | None = None) -> list:
    """Run ``code`` in ``world`` processes; each calls ``emit(obj)``; returns objs by rank.
    ``torch.distributed`` is initialized (gloo, env://) before ``code`` runs and torn down
    after it on every rank together: a rank that left while its peers still talked to it
    (rank 0 also hosts the rendezvous store) was seen to abort at exit ("terminate called
    without an active exception", exit -6) after emitting a correct result."""
    prelude = textwrap.dedent(f"""
        import json as _json, os as _os
        def emit(obj):
            print({MARK!r} + _json.dumps(obj), flush=True)
        import torch.distributed as dist
        dist.init_process_group("gloo")
        RANK = dist.get_rank()
        WORLD = dist.get_world_size()
    """)
    epilogue = textwrap.dedent("""
        dist.barrier()
        dist.destroy_process_group()
    """)
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ)
        e.update(env or {})
        e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([python or sys.executable, "-c", prelude + textwrap.dedent(code) + epilogue],
                                      env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results, failures = [], []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            failures.append(f"rank {rank} timed out\n{err[-3000:]}")
            continue
        got = [json.loads(line[len(MARK):]) for line in out.splitlines() if line.startswith(MARK)]
        if p.returncode != 0 or not got:
            failures.append(f"rank {rank} exit {p.returncode}\n--- stdout ---\n{out[-2000:]}\n"
                            f"--- stderr ---\n{err[-5000:]}")
        results.append(got[-1] if got else None)
    if failures:
        raise AssertionError("\n\n".join(failures))
    return results
