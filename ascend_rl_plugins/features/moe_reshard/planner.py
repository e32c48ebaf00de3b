"""The reshard planner: which rank sends which expert rows to which rank, in which round.

Pure and deterministic (numpy only, no torch, no communication): every rank computes the same
plan from the same shape and layouts, so the executor needs no metadata exchange. A plan depends
on nothing else, so each process keeps the plans it made (``PlanCache``, keyed by
``plan_key``) and plans again only when an input -- an expert map, after EPLB -- changes.

How it plans (see ``plan``):

1. *Needs.* For every rollout rank, the slices its vLLM loader keeps (``RolloutLayout.needed``):
   whole hosted experts under EP (a redundantly hosted expert is needed once, delivered to
   each slot), or its flattened-TP row interval of every expert without EP.
2. *Units.* Each need is cut at the training ETP shard boundaries; a unit is one piece of one
   need that lies inside one ETP shard, so exactly one set of training ranks (the expert
   data-parallel replicas of that shard) owns it.
3. *Sources.* The destination itself if it owns the unit (a free local copy); else one of the
   unit's owners (the expert data-parallel replicas of its shard). Every unit moves at most
   once, so the bytes received equal the minimum for the layout whichever owner sends
   (``validate`` and the property tests check it independently); the choice only spreads the
   sending. Each owner group gets a cap (the busiest member under a longest-first greedy
   assignment of the group's wire units: optimal for units of one size) and a unit goes to the
   least loaded owner on the destination's node (``ranks_per_node``) under the cap, else the
   least loaded owner under the cap, else the least loaded; ties to the lowest rank. The
   busiest sender is reported against ``sender_lower_bound``.
4. *Rounds.* Layer by layer, each need (all its units together) goes into the first round, at or
   after the last round opened so far, where every sender's send bytes and the receiver's
   receive bytes stay within ``bucket_bytes``; a rank with nothing yet in a round accepts one
   parcel even if larger than the bucket (a slice bigger than a bucket travels alone).
   Rounds therefore follow layer order, and within a round deliveries are sorted by layer.

Memory: the executor keeps at most two rounds in flight (send + receive buffers each), so
``peak_extra_bytes`` = max over consecutive rounds of ``send_k + recv_k + send_k+1 + recv_k+1``
(<= 4 buckets) plus the largest need assembled from several ETP pieces (one ``torch.cat``).
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field

import numpy as np

from .layout import PROJS, ExpertSlice, LayoutError, MoEShape, RolloutLayout, TrainingLayout


class PlanError(ValueError):
    """This layout cannot be planned; the message is a one-line reason (the caller falls back
    to the upstream path)."""


@dataclass(frozen=True)
class Transfer:
    """One unit: rows ``[lo, hi)`` of one expert projection from ``src`` to ``dst``
    (``src == dst``: a local copy, no wire bytes)."""
    slice: ExpertSlice
    src: int
    dst: int
    nbytes: int
    shard_lo: int            # first row of the training ETP shard the unit lies in

    @property
    def wire_bytes(self) -> int:
        return 0 if self.src == self.dst else self.nbytes


@dataclass(frozen=True)
class Delivery:
    """One needed slice on rank ``dst``: assembled from ``transfers`` (indices into
    ``Plan.transfers``, in row order) and yielded ``copies`` times."""
    slice: ExpertSlice
    dst: int
    copies: int
    transfers: tuple[int, ...]


@dataclass(frozen=True)
class Round:
    index: int
    transfers: tuple[int, ...]       # indices into Plan.transfers, canonical order
    deliveries: tuple[int, ...]      # indices into Plan.deliveries, (dst, layer, expert, proj) order


@dataclass(frozen=True)
class Plan:
    shape: MoEShape
    training: TrainingLayout
    rollout: RolloutLayout
    bucket_bytes: int
    ranks_per_node: int
    world: int
    transfers: tuple[Transfer, ...]
    deliveries: tuple[Delivery, ...]
    rounds: tuple[Round, ...]
    _sent: np.ndarray = field(repr=False, compare=False)      # [rounds, world] wire bytes sent
    _recv: np.ndarray = field(repr=False, compare=False)      # [rounds, world] wire bytes received
    _caps: dict = field(repr=False, compare=False, default_factory=dict)  # owner group -> sender cap

    # -- accounting ----------------------------------------------------------------------------
    def bytes_received(self, rank: int) -> int:
        return int(self._recv[:, rank].sum()) if len(self.rounds) else 0

    def bytes_sent(self, rank: int) -> int:
        return int(self._sent[:, rank].sum()) if len(self.rounds) else 0

    @property
    def total_bytes(self) -> int:
        return int(self._recv.sum())

    def round_bytes(self, rank: int) -> list[tuple[int, int]]:
        """``(sent, received)`` wire bytes of ``rank`` per round."""
        return [(int(s), int(r)) for s, r in zip(self._sent[:, rank], self._recv[:, rank])]

    @property
    def busiest_sender(self) -> int:
        """Wire bytes sent by the rank that sends the most (over all rounds)."""
        return int(self._sent.sum(axis=0).max()) if len(self.rounds) else 0

    @property
    def busiest_receiver(self) -> int:
        """Wire bytes received by the rank that receives the most (over all rounds)."""
        return int(self._recv.sum(axis=0).max()) if len(self.rounds) else 0

    def sender_cap(self, owners: tuple[int, ...]) -> int:
        """The load cap the planner gave the owner group ``owners`` (0: it sends nothing)."""
        return self._caps.get(tuple(owners), 0)

    def minimum_bytes(self, rank: int) -> int:
        """Bytes rollout ``rank`` must receive in any reshard: every needed row it does not
        already hold (computed from the layouts alone, not from the plan)."""
        return minimum_bytes(self.shape, self.training, self.rollout, rank)

    def assembled_bytes(self, rank: int) -> int:
        """The largest need of ``rank`` assembled from several pieces (one concatenation)."""
        best = 0
        for d in self.deliveries:
            if d.dst == rank and len(d.transfers) > 1:
                best = max(best, d.slice.rows * self.shape.row_bytes())
        return best

    def peak_extra_bytes(self, rank: int) -> int:
        """Peak communication memory of the double-buffered executor on ``rank``."""
        if not self.rounds:
            return 0
        per = self._sent[:, rank] + self._recv[:, rank]
        pair = per[:-1] + per[1:] if len(per) > 1 else per
        return int(pair.max()) + self.assembled_bytes(rank)

    def digest(self) -> str:
        """A hash of the whole plan (identical on every rank for identical inputs)."""
        h = hashlib.sha256()
        h.update(repr((self.shape, self.training, self.rollout, self.bucket_bytes, self.ranks_per_node)).encode())
        for r in self.rounds:
            h.update(f"R{r.index}".encode())
            for i in r.transfers:
                t = self.transfers[i]
                s = t.slice
                h.update(f"{s.layer},{s.expert},{s.proj},{s.lo},{s.hi},{t.src},{t.dst};".encode())
            for i in r.deliveries:
                d = self.deliveries[i]
                h.update(f"d{d.dst},{d.slice.layer},{d.slice.expert},{d.slice.proj},{d.copies},{d.transfers};".encode())
        return h.hexdigest()

    # -- self check ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise PlanError unless: every need of every rank is delivered exactly once, its
        units tile it exactly, every unit comes from a rank that owns it, each unit is in the
        round of its delivery, per-round caps hold, and wire bytes equal the minimum."""
        shape, training, rollout = self.shape, self.training, self.rollout
        owned = {r: set() for r in range(self.world)}
        for r in range(self.world):
            for s in training.owned(shape, r):
                owned[r].add((s.layer, s.expert, s.proj, s.lo, s.hi))
        wanted = {}
        for r in range(self.world):
            for s, copies in rollout.needed(shape, r):
                wanted[(r, s)] = copies
        got = {}
        round_of_transfer = {}
        for rd in self.rounds:
            for i in rd.transfers:
                if i in round_of_transfer:
                    raise PlanError(f"transfer {i} scheduled twice")
                round_of_transfer[i] = rd.index
        if len(round_of_transfer) != len(self.transfers):
            raise PlanError("a transfer is in no round")
        for rd in self.rounds:
            for di in rd.deliveries:
                d = self.deliveries[di]
                key = (d.dst, d.slice)
                if key in got:
                    raise PlanError(f"{key} delivered twice")
                got[key] = d.copies
                row = d.slice.lo
                for ti in d.transfers:
                    t = self.transfers[ti]
                    if round_of_transfer[ti] != rd.index:
                        raise PlanError(f"transfer {ti} not in the round of its delivery")
                    if t.dst != d.dst or t.slice.lo != row or t.slice.hi > d.slice.hi:
                        raise PlanError(f"units of {key} do not tile it")
                    row = t.slice.hi
                    n = training.shard_rows(shape)
                    shard = (t.slice.layer, t.slice.expert, t.slice.proj, t.shard_lo, t.shard_lo + n)
                    if shard not in owned[t.src] or not t.shard_lo <= t.slice.lo < t.slice.hi <= t.shard_lo + n:
                        raise PlanError(f"rank {t.src} does not own {t.slice}")
                if row != d.slice.hi:
                    raise PlanError(f"units of {key} do not cover it")
        if got != wanted:
            raise PlanError(f"{len(set(wanted) - set(got))} needs undelivered, {len(set(got) - set(wanted))} extra")
        cap = self.bucket_bytes
        for rd in self.rounds:
            sends: dict[int, dict[int, int]] = {}     # rank -> delivery -> bytes
            recvs: dict[int, dict[int, int]] = {}
            for di in rd.deliveries:
                for ti in self.deliveries[di].transfers:
                    t = self.transfers[ti]
                    if t.src != t.dst:
                        sends.setdefault(t.src, {}).setdefault(di, 0)
                        sends[t.src][di] += t.nbytes
                        recvs.setdefault(t.dst, {}).setdefault(di, 0)
                        recvs[t.dst][di] += t.nbytes
            for what, side in (("sends", sends), ("receives", recvs)):
                for r, parcels in side.items():
                    if sum(parcels.values()) > cap and len(parcels) > 1:
                        raise PlanError(f"round {rd.index}: rank {r} {what} {sum(parcels.values())} > bucket {cap}")
        for r in range(self.world):
            if self.bytes_received(r) != self.minimum_bytes(r):
                raise PlanError(f"rank {r} receives {self.bytes_received(r)} bytes, minimum {self.minimum_bytes(r)}")




def minimum_bytes(shape: MoEShape, training: TrainingLayout, rollout: RolloutLayout, rank: int) -> int:
    """Needed rows of ``rank`` that ``rank`` does not hold, in bytes (interval arithmetic on the
    layouts; independent of the planner's units)."""
    training = _training_for(training, rollout)
    held = {}
    for s in training.owned(shape, rank):
        held.setdefault((s.layer, s.expert, s.proj), []).append((s.lo, s.hi))
    total_rows = 0
    for s, _ in rollout.needed(shape, rank):
        rows = s.hi - s.lo
        for lo, hi in held.get((s.layer, s.expert, s.proj), ()):
            rows -= max(0, min(hi, s.hi) - max(lo, s.lo))
        total_rows += rows
    return total_rows * shape.row_bytes()


def receiver_lower_bound(shape: MoEShape, training: TrainingLayout, rollout: RolloutLayout) -> int:
    """No reshard can make its busiest receiver take less than this: the largest
    :func:`minimum_bytes` of any rank (a minimum-total plan's receivers are exactly these)."""
    return max(minimum_bytes(shape, training, rollout, r) for r in range(rollout.group_world()))


def sender_lower_bound(shape: MoEShape, training: TrainingLayout, rollout: RolloutLayout) -> int:
    """No reshard that keeps the total bytes at the minimum can make its busiest sender send less
    than this: the rows of every training shard needed by a rank outside the shard's owner group
    must leave that group once, so some owner sends at least ``ceil(W_G / |G|)`` of the group's
    wire bytes ``W_G`` (even if a unit could be split between owners). Computed from the layouts
    alone, by interval arithmetic, independent of the planner's units."""
    world = rollout.group_world()
    training = _training_for(training, rollout)
    n, e_loc = training.shard_rows(shape), training.local_experts(shape)
    table = training.owner_table(shape)
    wire: dict[tuple[int, ...], int] = {}
    for r in range(world):
        for s, _ in rollout.needed(shape, r):
            stage = training.stage_of_layer(s.layer, shape.num_layers)
            for j in range(s.lo // n, -(-s.hi // n)):
                owners = table[(stage, s.expert // e_loc, j)]
                rows = min(s.hi, (j + 1) * n) - max(s.lo, j * n)
                if r not in owners and rows > 0:
                    wire[owners] = wire.get(owners, 0) + rows * shape.row_bytes()
    return max((-(-w // len(g)) for g, w in wire.items()), default=0)


def _with_world(training: TrainingLayout, world: int) -> TrainingLayout:
    if training.dp is None:
        return training.with_world(world)
    if training.world_size() != world:
        raise LayoutError(f"training world {training.world_size()} != rollout world {world}")
    return training


def _training_for(training: TrainingLayout, rollout: RolloutLayout) -> TrainingLayout:
    """The training layout over its own ranks: the whole group when colocated, else the
    ``rollout.first_rank`` ranks before the rollout's (a checkpoint engine's group)."""
    if rollout.first_rank == 0:
        return _with_world(training, rollout.world_size())
    if training.dp is None:
        return training.with_world(rollout.first_rank)
    if training.world_size() != rollout.first_rank:
        raise LayoutError(f"training world {training.world_size()} != the {rollout.first_rank} ranks before the "
                          "rollout's (rollout first_rank)")
    return training


def plan(shape: MoEShape, training: TrainingLayout, rollout: RolloutLayout, *, bucket_bytes: int,
         ranks_per_node: int = 16, balance: bool = True) -> Plan:
    """Plan the reshard of every expert slice from ``training`` to ``rollout`` (see the module
    docstring). Raises PlanError with a one-line reason for a layout it cannot serve.

    ``balance=False`` is the earlier source rule (a same-node owner whenever one exists, the
    least loaded among them), kept as the benchmark's baseline: on layouts with replicated
    owners it can load one sender far above the others."""
    if bucket_bytes < 1 or ranks_per_node < 1:
        raise PlanError("bucket_bytes and ranks_per_node must be >= 1")
    world = rollout.group_world()
    try:
        training = _training_for(training, rollout)
        training.check()
        rollout.check(shape)
        n = training.shard_rows(shape)
        e_loc = training.local_experts(shape)
        stages = {layer: training.stage_of_layer(layer, shape.num_layers) for layer in shape.expert_layers}
        owner_table = training.owner_table(shape)
    except LayoutError as exc:
        raise PlanError(str(exc)) from None
    row_bytes = shape.row_bytes()
    node = [r // ranks_per_node for r in range(world)]

    needs_by_layer: dict[int, list[tuple[int, ExpertSlice, int]]] = {layer: [] for layer in shape.expert_layers}
    for r in range(world):
        for s, copies in rollout.needed(shape, r):
            needs_by_layer[s.layer].append((r, s, copies))

    # pass 1: every need cut into units (one per training ETP shard it touches), in the order the
    # rounds are filled: layer by layer, destination-major interleave within a layer (the parcels
    # of one layer alternate between receivers, so first-fit fills rounds evenly)
    work: list[tuple[int, ExpertSlice, int, list[_Unit]]] = []
    for layer in shape.expert_layers:
        stage = stages[layer]
        for dst, s, copies in sorted(needs_by_layer[layer], key=lambda x: (x[1].expert, PROJS.index(x[1].proj), x[0])):
            units = []
            row = s.lo
            while row < s.hi:
                j = row // n
                hi = min(s.hi, (j + 1) * n)
                owners = owner_table[(stage, s.expert // e_loc, j)]
                units.append(_Unit(ExpertSlice(layer, s.expert, s.proj, row, hi), owners, (hi - row) * row_bytes,
                                   j * n, dst if dst in owners else -1))
                row = hi
            work.append((dst, s, copies, units))

    # pass 2: sources. Any owner keeps the total at the minimum (each unit crosses once), so the
    # choice only decides how the load spreads: every owner group gets a cap (the makespan of a
    # longest-first greedy over its wire units), and a unit goes to the least loaded same-node
    # owner under the cap, else the least loaded owner under the cap, else the least loaded.
    caps = _sender_caps(u for _, _, _, units in work for u in units if u.src < 0)
    if not balance:
        caps = dict.fromkeys(caps, 1 << 62)
    load = [0] * world
    for dst, _, _, units in work:
        for u in units:
            if u.src >= 0:
                continue
            cap = caps[u.owners]
            fits = [o for o in u.owners if load[o] + u.nbytes <= cap]
            near = [o for o in fits if node[o] == node[dst]]
            u.src = min(near or fits or u.owners, key=lambda o: (load[o], o))
            load[u.src] += u.nbytes

    # pass 3: rounds (module docstring, step 4)
    sent_rows: list[list[int]] = []                   # per round, per rank (plain lists: scalar
    recv_rows: list[list[int]] = []                   # access to numpy elements is slow here)
    round_transfers: list[list[int]] = []
    round_deliveries: list[list[int]] = []
    transfers: list[Transfer] = []
    deliveries: list[Delivery] = []
    cap = bucket_bytes

    def new_round() -> int:
        sent_rows.append([0] * world)
        recv_rows.append([0] * world)
        round_transfers.append([])
        round_deliveries.append([])
        return len(sent_rows) - 1

    layer_now, start = None, 0
    for dst, s, copies, units in work:
        if s.layer != layer_now:
            layer_now, start = s.layer, max(len(sent_rows) - 1, 0)
        wire = [(u.src, u.nbytes) for u in units if u.src != dst]
        recv_total = sum(nb for _, nb in wire)
        send_by_src: dict[int, int] = {}
        for src, nb in wire:
            send_by_src[src] = send_by_src.get(src, 0) + nb
        k = start
        while True:
            if k == len(sent_rows):
                new_round()
            if not wire:
                break
            rv = recv_rows[k][dst]
            ok = rv == 0 or rv + recv_total <= cap
            if ok:
                for src, nb in send_by_src.items():
                    sv = sent_rows[k][src]
                    if not (sv == 0 or sv + nb <= cap):
                        ok = False
                        break
            if ok:
                break
            k += 1
        ids = []
        for u in units:
            ids.append(len(transfers))
            transfers.append(Transfer(u.slice, u.src, dst, u.nbytes, u.shard_lo))
            if u.src != dst:
                sent_rows[k][u.src] += u.nbytes
                recv_rows[k][dst] += u.nbytes
        round_transfers[k].extend(ids)
        round_deliveries[k].append(len(deliveries))
        deliveries.append(Delivery(s, dst, copies, tuple(ids)))

    def tkey(i: int):
        t = transfers[i]
        return (t.src, t.dst, t.slice.layer, t.slice.expert, PROJS.index(t.slice.proj), t.slice.lo)

    def dkey(i: int):
        d = deliveries[i]
        return (d.dst, d.slice.layer, d.slice.expert, PROJS.index(d.slice.proj), d.slice.lo)

    rounds = tuple(Round(k, tuple(sorted(ts, key=tkey)), tuple(sorted(ds, key=dkey)))
                   for k, (ts, ds) in enumerate(zip(round_transfers, round_deliveries)))
    empty = np.zeros((0, world), dtype=np.int64)
    return Plan(shape, training, rollout, bucket_bytes, ranks_per_node, world, tuple(transfers), tuple(deliveries),
                rounds, np.array(sent_rows, dtype=np.int64) if sent_rows else empty,
                np.array(recv_rows, dtype=np.int64) if recv_rows else empty,
                caps)


@dataclass
class _Unit:
    """One piece of one need inside one training ETP shard, while planning: ``owners`` are the
    ranks holding that shard (expert data-parallel replicas); ``src`` is -1 until chosen."""
    slice: ExpertSlice
    owners: tuple[int, ...]
    nbytes: int
    shard_lo: int
    src: int


def _sender_caps(wire_units) -> dict[tuple[int, ...], int]:
    """Per owner group, the busiest sender's bytes under a longest-first greedy assignment of the
    group's wire units to its members (at most the group's average plus its largest unit; for
    units of one size, ``ceil(units / owners)`` units: optimal)."""
    by_group: dict[tuple[int, ...], list[int]] = {}
    for u in wire_units:
        by_group.setdefault(u.owners, []).append(u.nbytes)
    caps = {}
    for owners, sizes in by_group.items():
        if len(set(sizes)) == 1:
            caps[owners] = -(-len(sizes) // len(owners)) * sizes[0]
            continue
        bins = [0] * len(owners)
        for nb in sorted(sizes, reverse=True):
            heapq.heapreplace(bins, bins[0] + nb)
        caps[owners] = max(bins)
    return caps


# ---------------------------------------------------------------------------------------------
# plan once: a plan depends only on its inputs, so each process keeps the plans it has made

PLANNER_VERSION = "2"   # part of every key: a plan cached by an older planner is never reused


def plan_key(shape: MoEShape, training: TrainingLayout, rollout: RolloutLayout, *, bucket_bytes: int,
             ranks_per_node: int = 16) -> str:
    """A digest of everything a plan depends on: the two layouts (the rollout's expert maps
    included), the expert geometry, the bucket and the node size. Built from the frozen
    dataclasses' reprs, so it is the same in every interpreter; ranks compare it to check they
    plan from the same inputs."""
    text = repr((PLANNER_VERSION, shape, training, rollout, int(bucket_bytes), int(ranks_per_node)))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Planned:
    """One plan lookup: the validated plan (or the refusal), its key, whether it was cached."""
    key: str
    plan: Plan | None
    refusal: str
    cached: bool

    def checked(self) -> Plan:
        """The plan, or PlanError with the refusal's one-line reason."""
        if self.plan is None:
            raise PlanError(self.refusal)
        return self.plan


class PlanCache:
    """The plans (and refusals) this process has made, by :func:`plan_key`, newest kept.

    Why: planning and validating a large layout takes seconds of CPU, but its inputs change only
    when a layout or an expert map does (EPLB moving experts); every other sync reuses the plan.
    A new expert map is a new key, so it is planned afresh; ``capacity`` bounds how many old
    layouts stay (EPLB can alternate between a few)."""

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self._plans: dict[str, Planned] = {}

    def get(self, shape: MoEShape, training: TrainingLayout, rollout: RolloutLayout, *, bucket_bytes: int,
            ranks_per_node: int = 16) -> Planned:
        key = plan_key(shape, training, rollout, bucket_bytes=bucket_bytes, ranks_per_node=ranks_per_node)
        hit = self._plans.pop(key, None)
        if hit is not None:
            self._plans[key] = hit                        # most recently used last
            return Planned(key, hit.plan, hit.refusal, True)
        try:
            made = plan(shape, training, rollout, bucket_bytes=bucket_bytes, ranks_per_node=ranks_per_node)
            made.validate()
            entry = Planned(key, made, "", False)
        except PlanError as exc:
            entry = Planned(key, None, str(exc), False)
        self._plans[key] = entry
        while len(self._plans) > self.capacity:
            self._plans.pop(next(iter(self._plans)))
        return entry

    def __len__(self) -> int:
        return len(self._plans)

    def reset(self) -> None:
        self._plans.clear()


CACHE = PlanCache()
