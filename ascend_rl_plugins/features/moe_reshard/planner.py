"""The reshard planner: which rank sends which expert rows to which rank, in which round.

Pure and deterministic (numpy only, no torch, no communication): every rank computes the same
plan from the same shape and layouts, so the executor needs no metadata exchange.

How it plans (see ``plan``):

1. *Needs.* For every rollout rank, the slices its vLLM loader keeps (``RolloutLayout.needed``):
   whole hosted experts under EP (a redundantly hosted expert is needed once, delivered to
   each slot), or its flattened-TP row interval of every expert without EP.
2. *Units.* Each need is cut at the training ETP shard boundaries; a unit is one piece of one
   need that lies inside one ETP shard, so exactly one set of training ranks (the expert
   data-parallel replicas of that shard) owns it.
3. *Sources.* The destination itself if it owns the unit (a free local copy); else an owner on
   the same node (``ranks_per_node``); among those (or all owners) the least loaded so far, ties
   to the lowest rank. Every unit moves at most once, so the bytes received equal the minimum
   for the layout by construction (``validate`` and the property tests check it independently).
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
    training = _with_world(training, rollout.world_size())
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


def _with_world(training: TrainingLayout, world: int) -> TrainingLayout:
    if training.dp is None:
        return training.with_world(world)
    if training.world_size() != world:
        raise LayoutError(f"training world {training.world_size()} != rollout world {world}")
    return training


def plan(shape: MoEShape, training: TrainingLayout, rollout: RolloutLayout, *, bucket_bytes: int,
         ranks_per_node: int = 16) -> Plan:
    """Plan the reshard of every expert slice from ``training`` to ``rollout`` (see the module
    docstring). Raises PlanError with a one-line reason for a layout it cannot serve."""
    if bucket_bytes < 1 or ranks_per_node < 1:
        raise PlanError("bucket_bytes and ranks_per_node must be >= 1")
    world = rollout.world_size()
    try:
        training = _with_world(training, world)
        training.check(world)
        rollout.check(shape)
        n = training.shard_rows(shape)
        e_loc = training.local_experts(shape)
        stages = {layer: training.stage_of_layer(layer, shape.num_layers) for layer in shape.expert_layers}
        owner_table = training.owner_table(shape)
    except LayoutError as exc:
        raise PlanError(str(exc)) from None
    row_bytes = shape.row_bytes()
    node = [r // ranks_per_node for r in range(world)]
    load = np.zeros(world, dtype=np.int64)            # cumulative bytes sent (source choice)
    sent_rows: list[np.ndarray] = []                  # per round, per rank
    recv_rows: list[np.ndarray] = []
    round_transfers: list[list[int]] = []
    round_deliveries: list[list[int]] = []
    transfers: list[Transfer] = []
    deliveries: list[Delivery] = []
    cap = bucket_bytes

    needs_by_rank = [rollout.needed(shape, r) for r in range(world)]
    needs_by_layer: dict[int, list[tuple[int, ExpertSlice, int]]] = {layer: [] for layer in shape.expert_layers}
    for r, needs in enumerate(needs_by_rank):
        for s, copies in needs:
            needs_by_layer[s.layer].append((r, s, copies))

    def new_round() -> int:
        sent_rows.append(np.zeros(world, dtype=np.int64))
        recv_rows.append(np.zeros(world, dtype=np.int64))
        round_transfers.append([])
        round_deliveries.append([])
        return len(sent_rows) - 1

    for layer in shape.expert_layers:
        start = max(len(sent_rows) - 1, 0)
        stage = stages[layer]
        # destination-major interleave: the parcels of one layer alternate between receivers,
        # so first-fit fills rounds evenly instead of one receiver at a time
        items = sorted(needs_by_layer[layer], key=lambda x: (x[1].expert, PROJS.index(x[1].proj), x[0]))
        for dst, s, copies in items:
            units = []
            row = s.lo
            while row < s.hi:
                j = row // n
                hi = min(s.hi, (j + 1) * n)
                owners = owner_table[(stage, s.expert // e_loc, j)]
                nbytes = (hi - row) * row_bytes
                if dst in owners:
                    src = dst
                else:
                    near = [o for o in owners if node[o] == node[dst]] or list(owners)
                    src = min(near, key=lambda o: (load[o], o))
                    load[src] += nbytes
                units.append((ExpertSlice(layer, s.expert, s.proj, row, hi), src, nbytes, j * n))
                row = hi
            wire = [(src, nb) for _, src, nb, _ in units if src != dst]
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
            for sl, src, nb, shard_lo in units:
                ids.append(len(transfers))
                transfers.append(Transfer(sl, src, dst, nb, shard_lo))
                if src != dst:
                    sent_rows[k][src] += nb
                    recv_rows[k][dst] += nb
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
                rounds, np.array(sent_rows) if sent_rows else empty, np.array(recv_rows) if recv_rows else empty)
