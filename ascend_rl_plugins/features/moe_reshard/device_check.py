"""Device check of the MoE reshard executor: every rank of several plans, in one process, on one device.

Why: the executor's packing (``copy_`` from Megatron storage into a flat send buffer, with the
GroupedMLP transpose and the gate/up split inside the copy), its unpacking (views of the receive
buffer, ``torch.cat`` of ETP pieces) and the placement of its buffers are device code; the gloo
tests only ever run them on the CPU. HCCL and NCCL accept device buffers only, so a buffer that
lands in host memory is a failure on an accelerator that CPU runs cannot show. This check runs
the real executor (``reshard_experts``, double-buffered ``_run`` included) for every rank of a
plan with expert weights on ``device`` and a loopback exchange that moves the bytes between the
ranks' buffers with torch copies on that device, so an accelerator owner can run it without a
process group (``ascend-rl selftest``) and the CPU tests run the same code.

What it proves, per layout and rank: every delivered tensor equals the reference HF expert
slice bit for bit (same dtype and shape), the rank receives exactly the slices its vLLM loader
keeps, once per hosted copy, in layer order, the wire bytes equal the layout's minimum, and
every send and receive buffer handed to the exchange (and every delivered tensor) is on
``device``.

No torch at import (the package rule): torch is imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from .layout import PROJS, MoEShape, RolloutLayout, TrainingLayout, hf_expert_name, rollout_view

CHECK_NAME = "moe_reshard.executor"
_WAIT_TIMEOUT_S = 120.0          # a loopback round waits this long for the other ranks' posts


@dataclasses.dataclass
class DeviceCheckResult:
    """The outcome of one device check (one row of ``ascend-rl selftest``)."""
    name: str
    ok: bool
    detail: str
    bytes_moved: int                 # wire bytes delivered over the loopback, all ranks and layouts
    seconds: float
    buffers_on_device: bool          # every buffer handed to the exchange was on the checked device


@dataclasses.dataclass(frozen=True)
class _Case:
    """One training -> rollout reshard to play on every rank."""
    label: str
    training: TrainingLayout
    rollout: RolloutLayout


@dataclasses.dataclass
class _RankPost:
    """What one rank handed to the exchange for one round."""
    send: object
    recv: object
    input_split_sizes: list
    output_split_sizes: list


class _LoopbackWork:
    """The work object the executor waits on: the copy into ``recv`` happens in ``wait()``."""

    def __init__(self, loopback: "_Loopback", rank: int, seq: int):
        self._loopback, self._rank, self._seq = loopback, rank, seq

    def wait(self) -> None:
        self._loopback.complete(self._rank, self._seq)


class _Loopback:
    """An all-to-all-v between the ranks of one plan, all played in this process (one thread
    per rank). Each rank's ``n``-th post is round ``n`` of the exchange (the executor posts the
    same rounds on every rank); ``wait()`` blocks until every rank has posted that round, then
    fills the waiting rank's ``recv`` from the others' ``send`` slices with torch copies on
    their device -- lazily, because the double-buffered executor posts round ``k+1`` before it
    waits for round ``k``, and a rank can run several rounds without yielding anything.

    Records the device of every buffer it is handed and the bytes each rank received."""

    def __init__(self, world: int):
        self.world = world
        self.buffer_devices: set = set()
        self.bytes_received = [0] * world
        self._cond = threading.Condition()
        self._posts: dict[int, dict[int, _RankPost]] = {}
        self._posted = [0] * world
        self._completed: dict[int, int] = {}
        self._failed: BaseException | None = None

    def for_rank(self, rank: int):
        """The ``exchange`` callable of ``rank`` (the executor's contract, see
        ``executor.all_to_all_exchange``)."""
        def exchange(recv, send, *, output_split_sizes, input_split_sizes, group=None):
            with self._cond:
                seq = self._posted[rank]
                self._posted[rank] += 1
                self._posts.setdefault(seq, {})[rank] = _RankPost(send, recv, list(input_split_sizes),
                                                                  list(output_split_sizes))
                self.buffer_devices.update((send.device, recv.device))
                self._cond.notify_all()
            return _LoopbackWork(self, rank, seq)
        return exchange

    def fail(self, exc: BaseException) -> None:
        """A rank died: release every rank waiting for it."""
        with self._cond:
            if self._failed is None:
                self._failed = exc
            self._cond.notify_all()

    def complete(self, rank: int, seq: int) -> None:
        with self._cond:
            done = self._cond.wait_for(lambda: self._failed is not None or len(self._posts[seq]) == self.world,
                                       timeout=_WAIT_TIMEOUT_S)
            if self._failed is not None:
                raise RuntimeError(f"rank {rank}: another rank failed during loopback round {seq}") from self._failed
            if not done:
                missing = sorted(set(range(self.world)) - set(self._posts[seq]))
                raise TimeoutError(f"loopback round {seq}: ranks {missing} never posted it (the ranks disagree "
                                   "on the rounds)")
            posts = self._posts[seq]
        mine = posts[rank]
        offset = 0
        for src in range(self.world):
            theirs = posts[src]
            n = theirs.input_split_sizes[rank]
            if n != mine.output_split_sizes[src]:
                raise RuntimeError(f"loopback round {seq}: rank {src} sends {n} elements to rank {rank}, which "
                                   f"expects {mine.output_split_sizes[src]}")
            start = sum(theirs.input_split_sizes[:rank])
            mine.recv[offset:offset + n].copy_(theirs.send[start:start + n])
            offset += n
        if offset != mine.recv.numel():
            raise RuntimeError(f"loopback round {seq}: rank {rank}'s receive buffer has {mine.recv.numel()} "
                               f"elements, the splits fill {offset}")
        with self._cond:
            self.bytes_received[rank] += mine.recv.numel() * mine.recv.element_size()
            self._completed[seq] = self._completed.get(seq, 0) + 1
            if self._completed[seq] == self.world:       # every rank has its copy: free the round
                del self._posts[seq]


def _shape(quick: bool) -> MoEShape:
    if quick:
        return MoEShape(num_layers=2, num_experts=8, hidden=64, ffn_hidden=32, dtype_bytes=2)
    return MoEShape(num_layers=4, num_experts=8, hidden=256, ffn_hidden=128, dtype_bytes=2)


def _cases(quick: bool) -> list[_Case]:
    """Layouts covering every storage (SequentialMLP, GroupedMLP with its transposed views,
    TEGroupedMLP), ETP pieces assembled by ``torch.cat``, pipeline stages, whole-expert and
    narrowed rollout loads, redundant and uneven expert maps."""
    redundant = RolloutLayout.from_expert_maps(1, 4, [[0, 1, 7, 2, 0], [2, 3], [4, 5], [6]])
    cases = [
        _Case("grouped tp2 ep2 etp2 -> vLLM EP linear tp1 x dp4",
              TrainingLayout(tp=2, ep=2, etp=2, expert_impl="grouped"), RolloutLayout.linear(1, 4, 8)),
        _Case("sequential tp1 ep4 -> vLLM tp4 without EP",
              TrainingLayout(tp=1, ep=4, etp=1, expert_impl="sequential"), RolloutLayout(4, 1)),
        _Case("te_grouped tp2 pp2 etp2 -> vLLM EP redundant + uneven maps",
              TrainingLayout(tp=2, pp=2, ep=1, etp=2, expert_impl="te_grouped"), redundant),
    ]
    if not quick:
        cases += [
            _Case("grouped tp1 pp2 (stages 0,0,0,1) ep2 -> vLLM EP round-robin tp2 x dp2",
                  TrainingLayout(tp=1, pp=2, ep=2, etp=1, expert_impl="grouped", layer_stages=(0, 0, 0, 1)),
                  RolloutLayout.round_robin(2, 2, 8)),
            _Case("grouped tp2 pp2 ep2 etp2, 8 ranks -> vLLM tp2 x dp4 without EP",
                  TrainingLayout(tp=2, pp=2, ep=2, etp=2, expert_impl="grouped"), RolloutLayout(2, 4)),
            _Case("te_grouped tp2 ep4 etp1, 8 ranks -> vLLM EP linear tp2 x dp4",
                  TrainingLayout(tp=2, ep=4, etp=1, expert_impl="te_grouped"), RolloutLayout.linear(2, 4, 8)),
        ]
    return cases


def _reference(shape: MoEShape, device) -> dict:
    """Random bf16 HF expert tensors on ``device`` (drawn on the CPU with a fixed seed, so every
    device checks the same bits)."""
    import torch
    g = torch.Generator().manual_seed(31)
    hf = {}
    for layer in shape.expert_layers:
        for e in range(shape.num_experts):
            for proj in PROJS:
                size = (shape.hidden, shape.ffn_hidden) if proj == "down_proj" else (shape.ffn_hidden, shape.hidden)
                hf[hf_expert_name(layer, e, proj)] = torch.randn(size, generator=g).bfloat16().to(device)
    return hf


def _expected(shape: MoEShape, rollout: RolloutLayout, rank: int) -> list[str]:
    names = []
    for s, copies in rollout.needed(shape, rank):
        names += [hf_expert_name(s.layer, s.expert, s.proj)] * copies
    return names


def _play(case: _Case, shape: MoEShape, hf: dict, device, bucket_bytes: int) -> tuple[list[str], int, set, int]:
    """Run ``case`` on every rank (one thread each) over a loopback; returns the problems found,
    the wire bytes moved, the devices of the exchanged buffers and the number of deliveries."""
    from .executor import reshard_experts
    from .layout import hf_to_megatron
    from .planner import plan
    import torch

    world = case.rollout.world_size()
    training = case.training.with_world(world)
    the_plan = plan(shape, training, case.rollout, bucket_bytes=bucket_bytes)
    local = {r: hf_to_megatron(hf, shape, training, r) for r in range(world)}
    loopback = _Loopback(world)
    problems: list[str] = []
    delivered = [0] * world
    lock = threading.Lock()

    def note(msg: str) -> None:
        with lock:
            problems.append(f"{case.label}: {msg}")

    def play_rank(rank: int) -> None:
        try:
            got = []
            for name, tensor in reshard_experts(local[rank], shape=shape, training=training, rollout=case.rollout,
                                                bucket_bytes=bucket_bytes, rank=rank, device=device,
                                                exchange=loopback.for_rank(rank)):
                got.append(name)
                want = rollout_view(hf[name], name.split(".")[-2], case.rollout, rank)
                if tensor.device != device:
                    note(f"rank {rank} {name} delivered on {tensor.device}, not {device}")
                elif tensor.dtype != want.dtype or tensor.shape != want.shape or not torch.equal(tensor, want):
                    note(f"rank {rank} {name} differs from the reference slice")
            delivered[rank] = len(got)
            expected = _expected(shape, case.rollout, rank)
            if sorted(got) != sorted(expected):
                missing = sorted(set(expected) - set(got))[:2]
                extra = sorted(set(got) - set(expected))[:2]
                note(f"rank {rank} got {len(got)} slices, needs {len(expected)} (missing e.g. {missing}, "
                     f"unexpected e.g. {extra})")
            layers = [int(n.split(".")[2]) for n in got]
            if layers != sorted(layers):
                note(f"rank {rank} deliveries are not in layer order")
        except BaseException as exc:  # noqa: BLE001 - reported as a failed check, peers released
            note(f"rank {rank} raised {type(exc).__name__}: {exc}")
            loopback.fail(exc)

    threads = [threading.Thread(target=play_rank, args=(r,), name=f"moe-reshard-rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not problems:
        for r in range(world):
            if loopback.bytes_received[r] != the_plan.minimum_bytes(r):
                note(f"rank {r} received {loopback.bytes_received[r]} wire bytes, the layout's minimum is "
                     f"{the_plan.minimum_bytes(r)}")
    return problems, sum(loopback.bytes_received), loopback.buffer_devices, sum(delivered)


def _synchronize(device) -> None:
    import torch
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and backend is not None and hasattr(backend, "synchronize"):
        backend.synchronize()


def run(device, *, quick: bool) -> DeviceCheckResult:
    """Reshard several MoE layouts on every rank with bf16 expert weights on ``device`` and a
    loopback exchange; see the module docstring for what passing means. ``quick``: a smaller
    model and fewer layouts (seconds on a CPU)."""
    import torch
    device = torch.empty(0, device=device).device       # "cuda" -> "cuda:0": the device tensors report
    shape = _shape(quick)
    bucket_bytes = 2 * shape.ffn_hidden * shape.row_bytes()    # two projections per round: many rounds
    t0 = time.perf_counter()
    hf = _reference(shape, device)
    problems: list[str] = []
    moved, deliveries, devices = 0, 0, set()
    cases = _cases(quick)
    for case in cases:
        case_problems, case_bytes, case_devices, case_deliveries = _play(case, shape, hf, device, bucket_bytes)
        problems += case_problems
        moved += case_bytes
        devices |= case_devices
        deliveries += case_deliveries
    _synchronize(device)
    seconds = time.perf_counter() - t0
    on_device = devices == {device}
    if not devices:
        problems.append("no buffer was handed to the exchange (nothing crossed ranks)")
    elif not on_device:
        problems.append(f"exchange buffers on {sorted(map(str, devices))}, expected only {device}")
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        detail = "; ".join(problems[:3]) + more
    else:
        detail = (f"{len(cases)} layouts, {deliveries} deliveries bit-identical to the HF reference, "
                  f"every rank got exactly its slices, {moved / 1e6:.2f} MB over the loopback, "
                  f"all buffers on {device}")
    return DeviceCheckResult(name=CHECK_NAME, ok=not problems, detail=detail, bytes_moved=moved, seconds=seconds,
                             buffers_on_device=on_device and bool(devices))


__all__ = ["DeviceCheckResult", "run", "CHECK_NAME"]
