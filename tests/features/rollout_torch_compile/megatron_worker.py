"""verl 0.6's Megatron ``ActorRolloutRefWorker`` on CPU, for child-process scenarios.

The worker is made without its ``__init__`` (which starts Megatron's parallel state with NCCL
and MindSpeed's repatch): ``Worker.__init__`` runs for real (rank, world size and dispatch
tables from the torchrun-style environment ``run_scenario`` gives), then the attributes the
methods under test read are set. Nothing of verl is replaced here; scenarios say what they
replace.
"""

from __future__ import annotations

import os

MINDSPEED_DOUBLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "doubles", "mindspeed_double")
DIST_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1"}


def require_verl_06(why_not: str) -> None:
    """Skip, saying ``why_not``, unless this interpreter has verl 0.6 (the recipe stack)."""
    import pytest
    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("verl")
    except PackageNotFoundError:
        pytest.skip("verl is not installed in this interpreter")
    if not v.startswith("0.6"):
        pytest.skip(f"verl {v}: {why_not}")


def dist_env(port: int) -> dict:
    return dict(DIST_ENV, MASTER_PORT=str(port))


def make_worker(config: dict, **attributes):
    """A real ``ActorRolloutRefWorker`` object with ``config`` (an OmegaConf of ``config``)
    and ``attributes`` set, its ``__init__`` skipped (see the module docstring)."""
    from omegaconf import OmegaConf
    from verl.single_controller.base import Worker
    from verl.workers.megatron_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    Worker.__init__(worker)
    worker.config = OmegaConf.create(config)
    for name, value in attributes.items():
        setattr(worker, name, value)
    return worker
