"""Which verl 0.9 server actors the backend's live expert-map reader looks in
(``verl09_rollout.SERVER_NAME``), checked against the names verl 0.9.1's own source gives them.

Static by necessity for the PD-disaggregated decode servers: a PD replica needs a KV-transfer
connector (NIXL / Mooncake) between its prefill and decode engines, which does not run on CPU.
The names are read from verl's installed source, rendered with sample values, and matched:
a verl release that renames its servers fails here instead of making every rank refuse."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from ascend_rl_plugins.features.moe_reshard.verl09_rollout import SERVER_NAME
from tests.support.stacks import require_installed

# f-strings in verl's vLLM rollout code that name a server actor: f"{prefix}server_..." or
# f"vllm_server_..." (prefix is vLLMReplica._get_server_name_prefix(): "vllm_")
NAME_FORMAT = re.compile(r'f"((?:\{prefix\}|vllm_)server_[^"]*)"')
SAMPLE = {"prefix": "vllm_", "self.replica_rank": "3", "node_rank": "1", "i": "2"}


def _verl_server_names(suffix: str) -> dict[str, str]:
    version = require_installed("verl")
    if not version.startswith("0.9."):
        pytest.skip(f"the checkpoint-engine backend is verl 0.9's (this stack has verl {version})")
    # located, not imported: importing verl's rollout package loads Ray and vLLM (seconds)
    package = Path(importlib.util.find_spec("verl").origin).parent / "workers" / "rollout" / "vllm_rollout"
    names = {}
    for module in ("vllm_async_server.py", "vllm_pd_replica.py"):
        source = (package / module).read_text()
        for template in NAME_FORMAT.findall(source):
            values = dict(SAMPLE, **{"self.name_suffix": suffix})
            names[template] = re.sub(r"\{([^}]*)\}", lambda m: values[m.group(1)], template)
    return names


@pytest.mark.parametrize("suffix", ["", "_colocate"])
def test_policy_and_pd_servers_match_and_reward_and_teacher_servers_do_not(suffix):
    names = _verl_server_names(suffix)
    matched = sorted(name for name in names.values() if SERVER_NAME.match(name))
    refused = sorted(name for name in names.values() if not SERVER_NAME.match(name))
    assert matched == sorted({f"vllm_server_3_1{suffix}", f"vllm_server_3_0{suffix}",
                              f"vllm_server_decode_3_2{suffix}"}), names
    assert refused == sorted({f"vllm_server_reward_3_1{suffix}", f"vllm_server_teacher_3_1{suffix}"}), names
