"""moe_reshard planner properties (hypothesis), checked by brute force independent of the
planner's own bookkeeping: every needed row delivered exactly once per destination, only from
a rank that holds it, wire bytes equal to the minimum for the layout, per-round caps, layer
order, the busiest sender and receiver against their lower bounds (same-node owners
preferred up to the balance cap), the same plan on every rank (and in another interpreter), and
layouts the seed's scheme cannot serve (rollout EP not a multiple of training EP, experts not
divisible by the rollout EP, ETP > 1, PP with uneven stages, redundant experts)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ascend_rl_plugins.features.moe_reshard.layout import PROJS, MoEShape, RolloutLayout, TrainingLayout
from ascend_rl_plugins.features.moe_reshard.planner import PlanError, plan, receiver_lower_bound, sender_lower_bound


@st.composite
def cases(draw):
    world = draw(st.sampled_from([1, 2, 4, 6, 8, 12]))
    pp = draw(st.sampled_from([p for p in (1, 2, 3) if world % p == 0]))
    per_stage = world // pp
    tp = draw(st.sampled_from([d for d in (1, 2, 3, 4) if per_stage % d == 0]))
    etp = draw(st.sampled_from([d for d in (1, 2, 4) if per_stage % d == 0]))
    ep = draw(st.sampled_from([d for d in (1, 2, 3, 4, 6) if (per_stage // etp) % d == 0]))
    experts = ep * draw(st.integers(1, 3))
    layers = draw(st.integers(pp, 2 * pp + 1))
    stages = tuple(sorted(draw(st.lists(st.integers(0, pp - 1), min_size=layers, max_size=layers)))) \
        if draw(st.booleans()) else None
    vpp = 1
    if stages is None:
        vpp = draw(st.sampled_from([1, 2]))
        layers = max(pp * vpp, pp * vpp * (layers // (pp * vpp)))
    moe_layers = tuple(sorted(set(draw(st.lists(st.integers(0, layers - 1), min_size=1, max_size=layers))))) \
        if draw(st.booleans()) else None
    ffn = etp * draw(st.sampled_from([1, 2, 3])) * (world if draw(st.booleans()) else 1)
    shape = MoEShape(num_layers=layers, num_experts=experts, hidden=draw(st.sampled_from([1, 4])),
                     ffn_hidden=ffn, moe_layers=moe_layers, dtype_bytes=draw(st.sampled_from([1, 2])))
    training = TrainingLayout(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, layer_stages=stages,
                              expert_impl=draw(st.sampled_from(["sequential", "grouped", "te_grouped"])))
    rtp = draw(st.sampled_from([d for d in (1, 2, 3, 4) if world % d == 0]))
    kind = draw(st.sampled_from(["linear", "round_robin", "maps", "tp"]))
    if kind == "tp" and ffn % world == 0:
        rollout = RolloutLayout(rtp, world // rtp)
    elif kind == "round_robin":
        rollout = RolloutLayout.round_robin(rtp, world // rtp, experts)
    elif kind == "maps":
        # every expert somewhere, plus random redundant copies (uneven counts, duplicates allowed)
        maps = [[] for _ in range(world)]
        for e in range(experts):
            maps[draw(st.integers(0, world - 1))].append(e)
        for _ in range(draw(st.integers(0, 4))):
            maps[draw(st.integers(0, world - 1))].append(draw(st.integers(0, experts - 1)))
        rollout = RolloutLayout.from_expert_maps(rtp, world // rtp, maps)
    else:
        rollout = RolloutLayout.linear(rtp, world // rtp, experts)
    row = shape.hidden * shape.dtype_bytes
    bucket = draw(st.integers(row, 4 * ffn * row * 2))
    return shape, training, rollout, bucket, draw(st.sampled_from([1, 2, 16]))


def _brute_force(shape, training, rollout, p):
    """Row-level facts from the layouts alone."""
    world = rollout.world_size()
    t = training.with_world(world)
    held = {r: set() for r in range(world)}
    for r in range(world):
        for s in t.owned(shape, r):
            held[r] |= {(s.layer, s.expert, s.proj, i) for i in range(s.lo, s.hi)}
    need = {r: {} for r in range(world)}
    for r in range(world):
        for e_slot in rollout.hosted(shape, r):
            lo, hi = rollout.needed_rows(shape, r)
            for layer in shape.expert_layers:
                for proj in PROJS:
                    need[r][(layer, e_slot, proj)] = (lo, hi)
    return t, held, need


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(cases())
def test_plan_delivers_every_needed_row_once_at_the_minimum_within_the_caps(case):
    shape, training, rollout, bucket, per_node = case
    p = plan(shape, training, rollout, bucket_bytes=bucket, ranks_per_node=per_node)
    p.validate()
    t, held, need = _brute_force(shape, training, rollout, p)
    row_bytes = shape.hidden * shape.dtype_bytes
    world = rollout.world_size()

    # exactly once: the rows arriving at each rank (wire + local) are its needed rows, no repeats
    for r in range(world):
        arrived = []
        for d in p.deliveries:
            if d.dst != r:
                continue
            for ti in d.transfers:
                tr = p.transfers[ti]
                assert tr.dst == r
                rows = [(tr.slice.layer, tr.slice.expert, tr.slice.proj, i) for i in range(tr.slice.lo, tr.slice.hi)]
                assert set(rows) <= held[tr.src], "sent by a rank that does not hold it"
                arrived += rows
        wanted = [(l, e, pr, i) for (l, e, pr), (lo, hi) in need[r].items() for i in range(lo, hi)]
        assert sorted(arrived) == sorted(set(wanted)), r
        # minimum: every needed row it does not hold crosses the wire once, nothing else does
        minimum = len(set(wanted) - held[r]) * row_bytes
        assert p.bytes_received(r) == minimum == p.minimum_bytes(r)
    assert p.total_bytes == sum(p.bytes_sent(r) for r in range(world))

    # caps: per round and rank, send and receive <= bucket unless one parcel alone
    for rd in p.rounds:
        for side in ("src", "dst"):
            load, parcels = {}, {}
            for di in rd.deliveries:
                for ti in p.deliveries[di].transfers:
                    tr = p.transfers[ti]
                    if tr.src != tr.dst:
                        who = getattr(tr, side)
                        load[who] = load.get(who, 0) + tr.nbytes
                        parcels.setdefault(who, set()).add(di)
            for who, b in load.items():
                assert b <= bucket or len(parcels[who]) == 1

    # rounds follow layer order
    spans = [(min(p.deliveries[d].slice.layer for d in rd.deliveries), max(p.deliveries[d].slice.layer for d in rd.deliveries))
             for rd in p.rounds if rd.deliveries]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))

    # balance: total at the minimum (above) and the busiest sender between its lower bound and
    # that bound plus one unit; busiest receiver at its bound; a unit crosses nodes only when
    # every same-node holder was at its owner group's cap
    sent = [p.bytes_sent(r) for r in range(world)]
    wire_units = [tr.nbytes for tr in p.transfers if tr.src != tr.dst]
    bound = sender_lower_bound(shape, training, rollout)
    assert bound <= p.busiest_sender <= bound + max(wire_units, default=0)
    assert p.busiest_receiver == receiver_lower_bound(shape, training, rollout)
    for tr in p.transfers:
        if tr.src != tr.dst:
            rows = {(tr.slice.layer, tr.slice.expert, tr.slice.proj, i) for i in range(tr.slice.lo, tr.slice.hi)}
            holders = tuple(o for o in range(world) if rows <= held[o])
            assert sent[tr.src] <= p.sender_cap(holders) or len(set(wire_units)) > 1
            if tr.src // per_node != tr.dst // per_node:
                near = [o for o in holders if o // per_node == tr.dst // per_node]
                assert all(sent[o] + tr.nbytes > p.sender_cap(holders) for o in near)

    # peak: two rounds in flight <= 4 buckets (a lone oversized parcel counts as its own bucket)
    biggest = max([d.slice.rows * row_bytes for d in p.deliveries] + [bucket])
    for r in range(world):
        assert p.peak_extra_bytes(r) - p.assembled_bytes(r) <= 4 * biggest

    # deterministic
    assert plan(shape, training, rollout, bucket_bytes=bucket, ranks_per_node=per_node).digest() == p.digest()


def test_non_divisible_expert_parallel_and_etp2_are_planned_at_the_minimum():
    # rollout EP 8 hosts 10 experts unevenly (2, 2, 1, ...), training EP 2 x ETP 2 x PP 2: the seed's
    # scheme needs experts divisible by the rollout EP and raises for ETP > 1; rows of one rollout
    # expert come from two ETP shards here.
    shape = MoEShape(num_layers=4, num_experts=10, hidden=16, ffn_hidden=8)
    training = TrainingLayout(tp=2, pp=2, ep=2, etp=2, expert_impl="grouped")
    rollout = RolloutLayout.linear(2, 4, 10)
    p = plan(shape, training, rollout, bucket_bytes=1024)
    p.validate()
    assert any(len(d.transfers) == 2 for d in p.deliveries)          # assembled from both ETP shards
    assert len(p.rounds) > 1
    # world 6: training EP 2 -> rollout EP 6 (6 % 2 == 0 but 8 experts over 6 ranks is uneven)
    p6 = plan(MoEShape(2, 8, 4, 6), TrainingLayout(tp=3, ep=2, etp=1), RolloutLayout.linear(1, 6, 8), bucket_bytes=64)
    p6.validate()
    # world 12: training TP2 x EP3 (9 experts) -> rollout EP 12: three rollout ranks host no expert
    p12 = plan(MoEShape(2, 9, 4, 6), TrainingLayout(tp=2, ep=3, etp=2), RolloutLayout.linear(6, 2, 9), bucket_bytes=100)
    p12.validate()
    assert [p12.bytes_received(r) for r in (9, 10, 11)] == [0, 0, 0]


def test_the_same_plan_in_another_interpreter():
    from tests.features.moe_reshard import planner_scenario
    from tests.support.child import run_scenario
    here = planner_scenario.digest_of_a_pipelined_round_robin_plan()
    there = run_scenario("tests.features.moe_reshard.planner_scenario", "digest_of_a_pipelined_round_robin_plan",
                         env={"PYTHONHASHSEED": "12345"})
    assert there == here
    key_here = planner_scenario.key_of_a_pipelined_round_robin_layout()
    key_there = run_scenario("tests.features.moe_reshard.planner_scenario", "key_of_a_pipelined_round_robin_layout",
                             env={"PYTHONHASHSEED": "54321"})
    assert key_there == key_here


# -- plan once ------------------------------------------------------------------------------------

def _replicated():
    """Training TP2 x EP2 on 8 ranks: every expert shard has 2 expert-DP owners; rollout EP8."""
    return (MoEShape(num_layers=4, num_experts=8, hidden=4, ffn_hidden=8), TrainingLayout(tp=2, ep=2),
            RolloutLayout.linear(2, 4, 8))


def test_a_plan_is_made_once_per_input_digest_and_again_when_an_expert_map_changes(monkeypatch):
    from ascend_rl_plugins.features.moe_reshard import planner
    shape, training, rollout = _replicated()
    made = []
    real = planner.plan
    monkeypatch.setattr(planner, "plan", lambda *a, **k: made.append(1) or real(*a, **k))
    cache = planner.PlanCache(capacity=2)
    first = cache.get(shape, training, rollout, bucket_bytes=256)
    again = cache.get(shape, training, rollout, bucket_bytes=256)
    assert not first.cached and again.cached and again.plan is first.plan and again.key == first.key
    assert len(made) == 1
    # EPLB swaps two experts between ranks 0 and 1: a new digest, planned afresh, delivering the new map
    maps = [list(m) for m in rollout.expert_maps]
    maps[0][0], maps[1][0] = maps[1][0], maps[0][0]
    moved = RolloutLayout.from_expert_maps(2, 4, maps)
    after = cache.get(shape, training, moved, bucket_bytes=256)
    assert not after.cached and after.key != first.key and len(made) == 2
    assert {d.slice.expert for d in after.plan.deliveries if d.dst == 0} == set(maps[0])
    # a refusal is cached too, with its one-line reason
    bad = RolloutLayout.from_expert_maps(2, 4, [[0]] * 8)
    refused = cache.get(shape, training, bad, bucket_bytes=256)
    with pytest.raises(PlanError, match="host 1 of 8 experts"):
        refused.checked()
    assert cache.get(shape, training, bad, bucket_bytes=256).cached and len(made) == 3
    # capacity 2: the oldest (the first layout) was dropped
    assert not cache.get(shape, training, rollout, bucket_bytes=256).cached
    # every input is in the key
    keys = {planner.plan_key(shape, training, rollout, bucket_bytes=256),
            planner.plan_key(shape, training, rollout, bucket_bytes=257),
            planner.plan_key(shape, training, rollout, bucket_bytes=256, ranks_per_node=8),
            planner.plan_key(shape, TrainingLayout(tp=2, ep=2, expert_impl="grouped"), rollout, bucket_bytes=256),
            planner.plan_key(MoEShape(4, 8, 4, 8, dtype_bytes=4), training, rollout, bucket_bytes=256),
            planner.plan_key(shape, training, moved, bucket_bytes=256)}
    assert len(keys) == 6


def test_a_plan_that_fails_validation_is_refused_with_its_reason(monkeypatch):
    from ascend_rl_plugins.features.moe_reshard import planner
    shape, training, rollout = _replicated()

    real = planner.plan

    def broken(*args, **kwargs):  # a planner bug: the first round lost
        p = real(*args, **kwargs)
        return planner.Plan(p.shape, p.training, p.rollout, p.bucket_bytes, p.ranks_per_node, p.world, p.transfers,
                            p.deliveries, p.rounds[1:], p._sent[1:], p._recv[1:], p._caps)
    monkeypatch.setattr(planner, "plan", broken)
    refused = planner.PlanCache().get(shape, training, rollout, bucket_bytes=256)
    assert refused.plan is None and "in no round" in refused.refusal


def test_replicated_owners_share_the_sending_at_the_lower_bound_with_the_total_at_the_minimum():
    """Four expert-DP owners of every shard, two nodes: the earlier rule (a same-node owner
    first) loads one owner per node with its node's needs; balanced, the busiest sender is at
    the lower bound and the total bytes are unchanged (the minimum)."""
    shape = MoEShape(num_layers=4, num_experts=8, hidden=4, ffn_hidden=8)
    training, rollout = TrainingLayout(tp=2, ep=2), RolloutLayout.linear(4, 4, 8)   # 16 ranks, edp 4
    balanced = plan(shape, training, rollout, bucket_bytes=256, ranks_per_node=8)
    nearest = plan(shape, training, rollout, bucket_bytes=256, ranks_per_node=8, balance=False)
    balanced.validate()
    nearest.validate()
    bound = sender_lower_bound(shape, training, rollout)
    assert balanced.busiest_sender == bound < nearest.busiest_sender
    assert balanced.total_bytes == nearest.total_bytes == sum(balanced.minimum_bytes(r) for r in range(16))
    assert balanced.busiest_receiver == receiver_lower_bound(shape, training, rollout)


@pytest.mark.parametrize("training,experts", [
    pytest.param(TrainingLayout(tp=4, ep=1), 2, id="edp4"),              # 6 units over 4 owners
    pytest.param(TrainingLayout(tp=5, ep=1), 2, id="edp5"),              # 6 units over 5 owners
    pytest.param(TrainingLayout(tp=8, ep=1, etp=2), 2, id="etp2-edp4"),  # two shards, 6 units over 4 owners each
])
def test_every_owner_of_a_shard_sends_its_share_not_the_lowest_ranks_up_to_the_cap(training, experts):
    """The owners of a shard (its expert data-parallel replicas) on one node share its wire units
    evenly: each sends the floor or the ceiling of its group's units over its members. The cap
    alone does not make that happen: with 6 units over 4 owners it is 2 units, and filling the
    lowest ranks up to it gives 2, 2, 2, 0 -- the same busiest sender, but one owner idle while
    another carries its share (the least-loaded rule gives 2, 2, 1, 1)."""
    shape = MoEShape(num_layers=1, num_experts=experts, hidden=4, ffn_hidden=4, dtype_bytes=2)
    trainers = training.tp
    rollout = RolloutLayout(1, 1, True, (tuple(range(experts)),), first_rank=trainers)   # one rank hosts all
    p = plan(shape, training, rollout, bucket_bytes=1 << 20, ranks_per_node=16)
    p.validate()
    unit = {t.nbytes for t in p.transfers if t.src != t.dst}
    assert len(unit) == 1, unit                                                   # units of one size
    unit = unit.pop()
    for owners in set(p.training.owner_table(shape).values()):
        sent = [p.bytes_sent(r) // unit for r in owners]
        share, extra = divmod(sum(sent), len(owners))
        assert sorted(sent) == [share] * (len(owners) - extra) + [share + 1] * extra, (owners, sent)


def test_oversized_slice_travels_alone():
    shape = MoEShape(num_layers=1, num_experts=2, hidden=4, ffn_hidden=8, dtype_bytes=2)   # 64 B per slice
    p = plan(shape, TrainingLayout(tp=1, ep=2), RolloutLayout.from_expert_maps(1, 2, [[1], [0]]), bucket_bytes=10)
    p.validate()
    for r in range(2):
        assert all(s <= 64 and rv <= 64 for s, rv in p.round_bytes(r))
    assert len(p.rounds) == 3 and p.bytes_received(0) == 3 * 64


@pytest.mark.parametrize("kwargs,match", [
    (dict(shape=MoEShape(1, 6, 4, 4), training=TrainingLayout(tp=1, ep=4), rollout=RolloutLayout(1, 4, True)),
     "not divisible by training ep"),
    (dict(shape=MoEShape(1, 4, 4, 6), training=TrainingLayout(tp=1, ep=4), rollout=RolloutLayout(4, 1)),
     "not divisible by rollout tp"),
    (dict(shape=MoEShape(1, 4, 4, 4), training=TrainingLayout(tp=3), rollout=RolloutLayout(4, 1)),
     "not divisible by tp"),
    (dict(shape=MoEShape(3, 4, 4, 4), training=TrainingLayout(tp=1, pp=2), rollout=RolloutLayout(2, 1)),
     "layer_stages"),
])
def test_unplannable_layouts_raise_a_one_line_plan_error(kwargs, match):
    with pytest.raises(PlanError, match=match) as info:
        plan(**kwargs, bucket_bytes=1024)
    assert "\n" not in str(info.value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(train=st.sampled_from([dict(tp=2, ep=2, etp=2), dict(tp=1, ep=2, etp=1), dict(tp=2, ep=4, etp=1),
                              dict(tp=1, ep=1, etp=2)]),
       replicas=st.integers(1, 3), replica_world=st.sampled_from([1, 2, 4]), placement=st.sampled_from(["l", "r"]))
def test_a_checkpoint_engine_group_sends_from_trainer_ranks_to_disjoint_rollout_ranks_at_the_minimum(
        train, replicas, replica_world, placement):
    """verl 0.9's checkpoint-engine group: trainer ranks [0, 4) hold the experts, rollout ranks
    [4, 4+R) (several replicas, each spreading every expert over its ranks) need them. Every
    rollout rank receives exactly its hosted experts' bytes, from owners only, the trainer ranks
    receive nothing, and the busiest sender stays at its lower bound's 1.1x."""
    shape = MoEShape(num_layers=2, num_experts=8, hidden=4, ffn_hidden=8, dtype_bytes=2)
    make = RolloutLayout.linear if placement == "l" else RolloutLayout.round_robin
    maps = [m for _ in range(replicas) for m in make(replica_world, 1, 8).expert_maps]
    rollout = RolloutLayout(1, len(maps), True, tuple(maps), first_rank=4)
    p = plan(shape, TrainingLayout(**train), rollout, bucket_bytes=256, ranks_per_node=2)
    p.validate()
    assert p.world == 4 + len(maps)
    for r in range(4):
        assert p.bytes_received(r) == 0 and rollout.needed(shape, r) == []
    for r in range(4, p.world):
        assert p.bytes_received(r) == len(maps[r - 4]) * 2 * shape.expert_layer_bytes()
        assert p.bytes_sent(r) == 0
    assert {t.src for t in p.transfers} <= set(range(4))
    assert p.busiest_receiver == receiver_lower_bound(shape, p.training, rollout)
    assert p.busiest_sender <= 1.1 * sender_lower_bound(shape, p.training, rollout) + 3 * shape.hidden * 2 * 8


def test_a_checkpoint_engine_group_needs_the_training_world_before_the_rollout_ranks():
    shape = MoEShape(num_layers=1, num_experts=4, hidden=4, ffn_hidden=4)
    rollout = RolloutLayout(1, 2, True, ((0, 1), (2, 3)), first_rank=4)
    with pytest.raises(PlanError, match="training world 2 != the 4 ranks before the rollout's"):
        plan(shape, TrainingLayout(tp=2, ep=2).with_world(2), rollout, bucket_bytes=64)
