"""moe_reshard device check and buffer placement: the executor run for every rank of several
plans in one process over a loopback exchange (``device_check.run``, what ``ascend-rl selftest``
calls), and where the executor allocates the buffers it hands to the collective, proven with
expert parameters on the ``meta`` device (no accelerator needed: a buffer allocated without the
parameters' device lands on the CPU and is seen here)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ascend_rl_plugins.features.moe_reshard import executor  # noqa: E402
from ascend_rl_plugins.features.moe_reshard.device_check import CHECK_NAME, DeviceCheckResult, run  # noqa: E402
from ascend_rl_plugins.features.moe_reshard.executor import reshard_experts  # noqa: E402
from ascend_rl_plugins.features.moe_reshard.layout import PROJS, MoEShape, RolloutLayout, TrainingLayout, \
    hf_expert_name, hf_to_megatron  # noqa: E402
from ascend_rl_plugins.features.moe_reshard.planner import PlanError  # noqa: E402

SHAPE = MoEShape(num_layers=2, num_experts=8, hidden=16, ffn_hidden=8, dtype_bytes=2)
# ETP 2 into whole experts: a delivery is assembled from two pieces (torch.cat); grouped storage
# (transposed views) is packed by copy_
TRAINING = TrainingLayout(tp=2, ep=2, etp=2, expert_impl="grouped").with_world(4)
ROLLOUT = RolloutLayout.linear(1, 4, 8)


def _hf(device) -> dict:
    out = {}
    for layer in SHAPE.expert_layers:
        for e in range(SHAPE.num_experts):
            for proj in PROJS:
                size = (SHAPE.hidden, SHAPE.ffn_hidden) if proj == "down_proj" else (SHAPE.ffn_hidden, SHAPE.hidden)
                out[hf_expert_name(layer, e, proj)] = torch.ones(size, dtype=torch.bfloat16, device=device)
    return out


class _RecordingExchange:
    """Records every buffer handed to the exchange; moves nothing (rank 0 alone)."""

    def __init__(self):
        self.buffers = []

    def __call__(self, recv, send, *, output_split_sizes, input_split_sizes, group=None):
        self.buffers += [("send", send), ("recv", recv)]
        return self

    def wait(self):
        pass


def test_quick_check_passes_on_cpu_with_every_buffer_on_the_cpu():
    result = run(torch.device("cpu"), quick=True)
    assert isinstance(result, DeviceCheckResult)
    assert result.name == CHECK_NAME
    assert result.ok, result.detail
    assert result.buffers_on_device
    assert result.bytes_moved > 0 and result.seconds > 0
    assert "bit-identical" in result.detail


def test_check_fails_when_the_exchanged_bytes_are_corrupted(monkeypatch):
    """The loopback copies at wait(): a send buffer changed after it was posted must show up as
    deliveries that differ from the reference."""
    original = executor._post

    def corrupting_post(*args, **kwargs):
        posted = original(*args, **kwargs)
        if posted.send.numel():
            posted.send.add_(1)
        return posted

    monkeypatch.setattr(executor, "_post", corrupting_post)
    result = run(torch.device("cpu"), quick=True)
    assert not result.ok
    assert "differs from the reference slice" in result.detail


def test_send_and_receive_buffers_are_allocated_on_the_parameters_device():
    """Expert parameters on ``meta``: every buffer the executor hands to the exchange, and every
    tensor it yields, must be on ``meta`` too (a buffer allocated without a device would be on
    the CPU: HCCL/NCCL refuse host buffers)."""
    local = hf_to_megatron(_hf("meta"), SHAPE, TRAINING, 0)
    assert {t.device.type for t in local.values()} == {"meta"}
    record = _RecordingExchange()
    yielded, failure = [], None
    try:        # a host buffer would also make a copy from/to meta raise: report the placement first
        for item in reshard_experts(local, shape=SHAPE, training=TRAINING, rollout=ROLLOUT,
                                    bucket_bytes=2 * 8 * 16 * 2, rank=0, exchange=record):
            yielded.append(item)
    except (RuntimeError, NotImplementedError) as exc:
        failure = exc
    assert [(kind, t.device) for kind, t in record.buffers if t.device.type != "meta"] == []
    assert failure is None, f"packing or unpacking mixed devices: {failure}"
    assert len(yielded) == len(ROLLOUT.hosted(SHAPE, 0)) * len(PROJS) * SHAPE.num_layers
    assert len(record.buffers) >= 4                            # several rounds posted
    assert any(kind == "recv" and t.numel() for kind, t in record.buffers)
    assert any(kind == "send" and t.numel() for kind, t in record.buffers)
    assert {t.device.type for _, t in yielded} == {"meta"}


def test_parameters_on_two_devices_raise_plan_error_before_any_exchange():
    local = hf_to_megatron(_hf("cpu"), SHAPE, TRAINING, 0)
    first = sorted(local)[0]
    local[first] = local[first].to("meta")
    record = _RecordingExchange()
    with pytest.raises(PlanError, match="one device"):
        reshard_experts(local, shape=SHAPE, training=TRAINING, rollout=ROLLOUT, bucket_bytes=1 << 20, rank=0,
                        exchange=record)
    assert record.buffers == []


def test_injected_exchange_without_a_group_needs_the_rank():
    local = hf_to_megatron(_hf("cpu"), SHAPE, TRAINING, 0)
    with pytest.raises(ValueError, match="needs rank="):
        reshard_experts(local, shape=SHAPE, training=TRAINING, rollout=ROLLOUT, bucket_bytes=1 << 20,
                        exchange=_RecordingExchange())
