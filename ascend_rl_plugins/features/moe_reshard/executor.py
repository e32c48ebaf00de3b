"""The reshard executor: runs a ``planner.Plan`` with ``all_to_all_single``, two rounds in flight.

Why: stock verl gathers every expert on every rank (and PP-broadcasts every EP shard first);
this moves each needed slice once, straight from an owner to the rollout rank that keeps it.

Per round (identical on every rank, from the plan):

* *pack* -- one flat send buffer, destination-major in rank order (``all_to_all_single``'s
  ``input_split_sizes``), each unit copied straight from the parameter storage into its region
  with ``copy_`` into a view of HF shape: GroupedMLP's ``[E_loc, H, 2I/etp]`` gate/up
  de-interleave and the transpose to HF ``[out, in]`` happen inside that one copy, no
  intermediate full copy of a parameter;
* *exchange* -- ``all_to_all_single(recv, send, output_split_sizes, input_split_sizes,
  async_op=True)`` (or a caller's ``exchange`` with the same contract, see
  :func:`all_to_all_exchange`); round ``k+1`` is packed and posted before round ``k`` is waited
  for and yielded (double buffering); a round with no wire bytes anywhere posts nothing;
* *yield* -- the deliveries of this rank in (layer, expert, projection) order:
  ``(hf_expert_name, tensor)``, once per hosted copy. A tensor is a view into the round's
  receive buffer (or, for rows this rank already holds, a view of its own parameter); a need
  assembled from several ETP pieces is one ``torch.cat``. The consumer must load (copy) each
  tensor before asking for the next round's tensors to keep the peak at ``Plan.peak_extra_bytes``
  (<= 4 buckets): a view kept alive keeps its whole receive buffer alive, but is never
  overwritten (every round allocates fresh buffers).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping

from .layout import PROJS, LayoutError, MoEShape, RolloutLayout, TrainingLayout, hf_expert_name, \
    megatron_to_hf, narrow_rows, slice_shape
from .planner import CACHE, Plan, PlanCache, PlanError


def _local_views(local_params: Mapping, shape: MoEShape, training: TrainingLayout, rank: int) -> dict:
    """``(layer, expert, proj) -> (shard_lo, hf_view)`` of this rank's expert shards."""
    views = {}
    for name, tensor in local_params.items():
        for _, sl, view in megatron_to_hf(name, tensor.detach(), shape, training, rank):
            views[(sl.layer, sl.expert, sl.proj)] = (sl.lo, view)
    return views


def all_to_all_exchange(recv, send, *, output_split_sizes: list[int], input_split_sizes: list[int], group):
    """The default exchange: one asynchronous ``all_to_all_single`` over ``group``.

    The exchange is a parameter of the executor so that one process can play every rank of a
    plan (``device_check`` does, with a loopback that copies between the ranks' buffers on the
    device) and check packing, unpacking and buffer placement without a process group. Any
    replacement takes the same arguments and returns an object whose ``wait()`` returns once
    ``recv`` holds what the other ranks sent (``recv`` is read only after ``wait()``; ``send``
    is kept alive until then)."""
    import torch.distributed as dist
    return dist.all_to_all_single(recv, send, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=True)


@dataclasses.dataclass
class _Posted:
    """One round in flight: its buffers, the async work, and where each unit landed."""
    index: int
    send: object
    recv: object
    work: object
    offsets: dict          # transfer index -> element offset in recv


def _post(p: Plan, k: int, me: int, views: dict, dtype, device, group, exchange=None) -> _Posted:
    import torch
    rd = p.rounds[k]
    shape = p.shape
    row_elems = shape.hidden
    world = p.world
    in_splits = [0] * world
    out_splits = [0] * world
    mine_out, mine_in = [], []
    for ti in rd.transfers:                 # canonical order: (src, dst, layer, expert, proj, lo)
        t = p.transfers[ti]
        if t.src == t.dst:
            continue
        elems = t.slice.rows * row_elems
        if t.src == me:
            in_splits[t.dst] += elems
            mine_out.append(ti)
        if t.dst == me:
            out_splits[t.src] += elems
            mine_in.append(ti)
    send = torch.empty(sum(in_splits), dtype=dtype, device=device)  # where the parameters are: HCCL/NCCL
    # take device buffers only, and packing stays a device-to-device copy
    off = 0
    for ti in mine_out:                     # already destination-major (sorted by src, then dst)
        t = p.transfers[ti]
        sl = t.slice
        shard_lo, view = views[(sl.layer, sl.expert, sl.proj)]
        n = sl.rows * row_elems
        region = send[off:off + n].view(slice_shape(shape, sl.proj, sl.rows))
        region.copy_(narrow_rows(view, sl.proj, sl.lo - shard_lo, sl.hi - shard_lo))
        off += n
    recv = torch.empty(sum(out_splits), dtype=dtype, device=device)
    offsets, off = {}, 0
    for ti in mine_in:                      # source-major, the order the sources packed them
        offsets[ti] = off
        off += p.transfers[ti].slice.rows * row_elems
    work = None
    if p._sent[k].sum() > 0:                # some rank moves bytes this round: all must join
        work = (exchange or all_to_all_exchange)(recv, send, output_split_sizes=out_splits,
                                                 input_split_sizes=in_splits, group=group)
    return _Posted(k, send, recv, work, offsets)


def _deliver(p: Plan, posted: _Posted, me: int, views: dict) -> Iterator[tuple[str, object]]:
    import torch
    shape = p.shape
    for di in p.rounds[posted.index].deliveries:
        d = p.deliveries[di]
        if d.dst != me:
            continue
        pieces = []
        for ti in d.transfers:
            t = p.transfers[ti]
            sl = t.slice
            if t.src == me:
                shard_lo, view = views[(sl.layer, sl.expert, sl.proj)]
                pieces.append(narrow_rows(view, sl.proj, sl.lo - shard_lo, sl.hi - shard_lo))
            else:
                off = posted.offsets[ti]
                n = sl.rows * shape.hidden
                pieces.append(posted.recv[off:off + n].view(slice_shape(shape, sl.proj, sl.rows)))
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1 if d.slice.proj == "down_proj" else 0)
        name = hf_expert_name(d.slice.layer, d.slice.expert, d.slice.proj)
        for _ in range(d.copies):
            yield name, tensor


@dataclasses.dataclass
class Prepared:
    """A reshard ready to run on this rank: the (validated, possibly cached) plan and this
    rank's expert views. Nothing has been communicated yet; :meth:`stream` runs it (collective:
    every rank of the plan must stream). ``key`` is the plan's input digest, which the callers
    compare across ranks before anyone streams."""
    plan: Plan
    key: str
    cached: bool
    rank: int
    views: dict
    dtype: object
    device: object
    group: object
    exchange: object

    def stream(self) -> Iterator[tuple[str, object]]:
        return _run(self.plan, self.rank, self.views, self.dtype, self.device, self.group, self.exchange)


def prepare_reshard(local_params: Mapping, *, shape: MoEShape, training: TrainingLayout, rollout: RolloutLayout,
                    bucket_bytes: int, group=None, rank: int | None = None, ranks_per_node: int = 16,
                    dtype=None, device=None, exchange=None, cache: PlanCache | None = None) -> Prepared:
    """Everything :func:`reshard_experts` does before its first communication: the plan (from
    ``cache``, default the process's :data:`planner.CACHE`; planned and validated on a miss)
    and this rank's views. Raises PlanError (one-line reason) for a layout the planner refuses,
    a plan that fails validation, or local parameters that do not match the layout."""
    import torch
    import torch.distributed as dist
    if dtype is None:
        dtypes = {t.dtype for t in local_params.values()}
        if len(dtypes) != 1:
            raise PlanError(f"expert parameters must share one dtype (got {sorted(map(str, dtypes))}); pass dtype=")
        dtype = dtypes.pop()
    shape = dataclasses.replace(shape, dtype_bytes=torch.empty((), dtype=dtype).element_size())
    if device is None:
        devices = {t.device for t in local_params.values()}
        if len(devices) > 1:
            raise PlanError(f"expert parameters must be on one device (got {sorted(map(str, devices))}); pass device=")
        device = devices.pop() if devices else torch.device("cpu")
    device = torch.device(device)
    if exchange is not None and group is None:
        world, me = rollout.group_world(), rank
        if me is None or not 0 <= me < world:
            raise ValueError(f"an injected exchange without a group needs rank= in [0, {world}) (got {me})")
    else:
        world = dist.get_world_size(group) if dist.is_initialized() else rollout.group_world()
        me = dist.get_rank(group) if rank is None else rank
    if world != rollout.group_world():
        raise PlanError(f"group has {world} ranks, the rollout layout {rollout.group_world()}")
    planned = (CACHE if cache is None else cache).get(shape, training, rollout, bucket_bytes=bucket_bytes,
                                                       ranks_per_node=ranks_per_node)
    the_plan = planned.checked()
    try:
        views = _local_views(local_params, shape, the_plan.training, me)
    except LayoutError as exc:
        raise PlanError(str(exc)) from None
    owned = {(s.layer, s.expert, s.proj) for s in the_plan.training.owned(shape, me)}
    if owned - set(views):
        missing = sorted(owned - set(views))[0]
        raise PlanError(f"rank {me} lacks expert parameters it owns, e.g. layer {missing[0]} expert {missing[1]} "
                        f"{missing[2]}")
    return Prepared(the_plan, planned.key, planned.cached, me, views, dtype, device, group, exchange)


def reshard_experts(local_params: Mapping, *, shape: MoEShape, training: TrainingLayout, rollout: RolloutLayout,
                    bucket_bytes: int, group=None, rank: int | None = None, ranks_per_node: int = 16,
                    dtype=None, device=None, exchange=None, cache: PlanCache | None = None
                    ) -> Iterator[tuple[str, object]]:
    """Yield, on every rollout rank, ``(hf_expert_name, tensor)`` for exactly the expert slices
    this rank's vLLM loader keeps (see ``layout.rollout_view``), in layer order, once per
    hosted copy.

    ``local_params``: this rank's Megatron expert parameters by name with *global* layer
    numbers (``decoder.layers.{L}.mlp.experts.local_experts.{i}.linear_fc1.weight`` /
    ``...experts.weight1`` / ``...experts.linear_fc1.weight{i}``). Collective over ``group``
    (default WORLD): every rank calls it with the same shape and layouts. A layout the planner
    cannot serve raises PlanError before any communication (the caller falls back); the plan is
    made once per input digest and kept in ``cache`` (:func:`prepare_reshard`).

    Send and receive buffers are allocated on ``device`` (default: the device of the local
    parameters, which must all be on one; a rank without expert parameters uses the CPU
    unless ``device`` is given): collective backends other than gloo accept device buffers
    only, and packing from device parameters into host memory would cross PCIe per slice.

    ``exchange`` replaces the collective (default :func:`all_to_all_exchange`, same contract).
    With an ``exchange`` and no ``group``, torch.distributed is not consulted at all: ``rank``
    is required and the world is the rollout layout's, so one process can run every rank of a
    plan against a loopback (``device_check.run``)."""
    return prepare_reshard(local_params, shape=shape, training=training, rollout=rollout, bucket_bytes=bucket_bytes,
                           group=group, rank=rank, ranks_per_node=ranks_per_node, dtype=dtype, device=device,
                           exchange=exchange, cache=cache).stream()


def _run(p: Plan, me: int, views: dict, dtype, device, group, exchange=None) -> Iterator[tuple[str, object]]:
    rounds = len(p.rounds)
    if rounds == 0:
        return
    with _no_grad():
        current = _post(p, 0, me, views, dtype, device, group, exchange)
    for k in range(rounds):
        with _no_grad():
            following = _post(p, k + 1, me, views, dtype, device, group, exchange) if k + 1 < rounds else None
        if current.work is not None:
            current.work.wait()
        current.send = None                 # the send buffer is free once the exchange is done
        yield from _deliver(p, current, me, views)
        current = following


def _no_grad():
    import torch
    return torch.no_grad()


__all__ = ["reshard_experts", "prepare_reshard", "Prepared", "all_to_all_exchange", "PlanError", "PROJS"]
