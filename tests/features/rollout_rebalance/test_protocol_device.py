"""Where the rebalance protocol's all-to-all buffers live: on the DP group's collective device
(the CPU for gloo, the current CUDA device for NCCL, the current NPU for HCCL), so that NCCL and
HCCL get the device tensors they require and KV blocks make no host round trip.

Real: torch.distributed.get_backend's answer for a real gloo group (2 processes), and
all_to_all_bytes / all_to_all_objects over it. Doubles: the backend name for NCCL/HCCL (no
accelerator here), and a recording all_to_all_single with the collective device reported as
``meta`` (a device that is not the CPU, with no data: every buffer allocated anywhere else
would be seen)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from ascend_rl_plugins.features.rollout_rebalance import protocol  # noqa: E402
from tests.support.child import run_group, run_scenario  # noqa: E402

ENV = {"ASCEND_RL_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("backend", ["gloo", "mpi", "ucc", "cpu:gloo"])
def test_host_backends_use_the_cpu(monkeypatch, backend):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    assert protocol.collective_device(object()) == torch.device("cpu")


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_uses_the_current_cuda_device(monkeypatch, backend):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert protocol.collective_device(object()) == torch.device("cuda", 3)


def hccl_device() -> str:
    """Child process: torch_npu's registrations played by hand (the ``npu`` device name and
    ``torch.npu``), the backend reported as HCCL."""
    import torch as t
    t.utils.rename_privateuse1_backend("npu")
    t.npu = types.SimpleNamespace(current_device=lambda: 5)
    t.distributed.get_backend = lambda group=None: "hccl"
    return str(protocol.collective_device(object()))


def test_hccl_uses_the_current_npu_device():
    assert run_scenario(__name__, "hccl_device", env=ENV, timeout=300) == "npu:5"


class _MetaSizesMode(torch.overrides.TorchFunctionMode):
    """Answers the one device-to-host read of all_to_all_bytes (``recv_sizes.tolist()``) for a
    ``meta`` tensor, which has no data, with the sizes the recording collective says arrived."""

    def __init__(self, sizes):
        super().__init__()
        self.sizes = sizes

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        if func is torch.Tensor.tolist and args[0].device.type == "meta":
            return list(self.sizes)
        return func(*args, **(kwargs or {}))


def test_every_all_to_all_buffer_is_on_the_collective_device(monkeypatch):
    calls = []

    def recording_all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                                    async_op=False):
        calls.append((output, input, output_split_sizes, input_split_sizes))

    monkeypatch.setattr(protocol, "collective_device", lambda group: torch.device("meta"))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(torch.distributed, "all_to_all_single", recording_all_to_all_single)
    kv_on_cpu = torch.arange(12, dtype=torch.float32).to(torch.bfloat16).reshape(3, 4)
    kv_on_meta = torch.empty(2, 5, dtype=torch.bfloat16, device="meta")
    with _MetaSizesMode([7, 0, 4]):
        received = protocol.all_to_all_bytes([kv_on_cpu, b"", protocol._as_bytes(kv_on_meta)], object())
    assert len(calls) == 2                                       # sizes, then the payload
    (recv_sizes, send_sizes, _, _), (recv, sends, out_split, in_split) = calls
    buffers = {"recv_sizes": recv_sizes, "send_sizes": send_sizes, "recv": recv, "sends": sends}
    assert {name: t.device.type for name, t in buffers.items()} == dict.fromkeys(buffers, "meta")
    assert in_split == [24, 0, 20] and out_split == [7, 0, 4]    # bf16 bytes per destination
    assert sends.numel() == 44 and recv.numel() == 11
    assert [t.device.type for t in received] == ["meta"] * 3 and [t.numel() for t in received] == [7, 0, 4]


def test_kv_bytes_stay_on_the_kv_device():
    kv = torch.empty(4, 6, dtype=torch.float16, device="meta")
    buf = protocol._as_bytes(kv)
    assert buf.device.type == "meta" and buf.dtype == torch.uint8 and buf.numel() == 48


def gloo_exchange() -> dict:
    """On each rank of a real gloo group: the collective device and a round trip of a bf16 KV
    tensor and of objects."""
    import torch as t
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    kv = (t.arange(6, dtype=t.float32) + 10 * rank).to(t.bfloat16).reshape(2, 3)
    chunks = [protocol._as_bytes(kv) if d != rank else b"" for d in range(world)]
    got = protocol.all_to_all_bytes(chunks, dist.group.WORLD)
    peer = 1 - rank
    peer_kv = got[peer].view(t.bfloat16).reshape(2, 3)
    objects = protocol.all_to_all_objects([{"from": rank, "to": d} for d in range(world)], dist.group.WORLD)
    return {"device": str(protocol.collective_device(dist.group.WORLD)),
            "received_devices": sorted({str(b.device) for b in got}),
            "peer_kv": peer_kv.float().tolist(), "own_bytes": got[rank].numel(), "objects": objects}


def test_gloo_group_exchanges_on_the_cpu():
    results = run_group(__name__, "gloo_exchange", 2, env=ENV, timeout=300)
    for rank, r in enumerate(results):
        peer = 1 - rank
        assert r["device"] == "cpu" and r["received_devices"] == ["cpu"]
        assert r["peer_kv"] == [[10.0 * peer + i for i in range(3)], [10.0 * peer + i for i in range(3, 6)]]
        assert r["own_bytes"] == 0
        assert r["objects"] == [{"from": src, "to": rank} for src in range(2)]
