"""Layout algebra of MoE expert weights: which rank holds which rows of which expert.

Pure (no torch at import; the tensor helpers take tensors but never import torch), shared by
the reshard planner, its executor and the HF <-> Megatron-Core grouped-GEMM converter, so that
every direction uses one tested mapping.

Why it exists: training (Megatron-Core) and rollout (vLLM) cut the same expert weights
differently, and a reshard that moves each byte once has to know both cuts exactly.

The common coordinate is the HF tensor of one expert projection (``gate_proj``/``up_proj``
``[I, H]``, ``down_proj`` ``[H, I]``) and an interval ``[lo, hi)`` along its ``I`` axis
(rows of gate/up, columns of down): every shard either side is such an interval.

Training side (Megatron-Core, read in core 0.12.1 and 0.16.1):

* ranks get coordinates by ``RankGenerator``: a mixed-radix decomposition of the global rank
  in the order string (default ``tp-cp-ep-dp-pp``, first token fastest), once for the dense
  grid (tp, cp, dp, pp) and once for the expert grid (tp = etp, ep, dp = world/(etp*ep*pp),
  pp; cp folded to 1) -- the two grids share their pp groups;
* expert-parallel rank ``k`` holds global experts ``k*E/ep .. (k+1)*E/ep - 1`` (local index
  ``i`` is global ``k*E/ep + i``); expert-tensor-parallel rank ``j`` holds ``I``-rows
  ``[j*I/etp, (j+1)*I/etp)`` of gate and of up (fc1 stores ``[gate_j; up_j]``) and the same
  columns of down (fc2 ``[H, I/etp]``);
* storage: SequentialMLP ``local_experts.{i}.linear_fc1.weight`` ``[2I/etp, H]`` and
  ``linear_fc2.weight`` ``[H, I/etp]``; TEGroupedMLP ``linear_fc1.weight{i}`` /
  ``linear_fc2.weight{i}`` the same shapes; legacy GroupedMLP ``weight1`` ``[H, E_loc*2I/etp]``
  (memory ``[E_loc, H, 2I/etp]``, per expert ``[gate_j | up_j]`` by columns) and ``weight2``
  ``[E_loc*I/etp, H]`` (memory ``[E_loc, I/etp, H]``), i.e. the transposes of the HF shards;
* pipeline stage of a layer: an even split into ``pp*vpp`` chunks, chunk ``c`` on pp rank
  ``c % pp`` (interleaved virtual stages), or an explicit ``layer_stages`` for uneven splits.

Rollout side (vLLM 0.13 / 0.23 ``FusedMoE``): with ``enable_expert_parallel`` the EP group is the
flattened ``tp*dp`` ranks (ep rank = dp_rank*tp + tp_rank) and every hosted expert is loaded
whole; the stock placement (``determine_expert_map``) is ``linear`` (contiguous blocks, the first
``E % ep`` ranks one more) or ``round_robin`` (``e % ep == rank``); any other map (redundant or
uneven experts, e.g. EPLB's) is given explicitly. Without EP the MoE tensor-parallel group is
the flattened ``tp*dp`` ranks, and ``_load_w13``/``_load_w2`` narrow gate/up rows and down
columns to ``[r*I/T, (r+1)*I/T)`` for flattened rank ``r`` of ``T = tp*dp``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

PROJS = ("gate_proj", "up_proj", "down_proj")
EXPERT_IMPLS = ("sequential", "grouped", "te_grouped")


class LayoutError(ValueError):
    """A layout that cannot exist (sizes that do not divide, an unknown name...)."""


# ---------------------------------------------------------------------------------------------
# shapes

@dataclass(frozen=True)
class MoEShape:
    """The model's expert geometry."""
    num_layers: int
    num_experts: int
    hidden: int
    ffn_hidden: int                                   # moe intermediate size I
    moe_layers: tuple[int, ...] | None = None         # global layer ids that are MoE (None = all)
    dtype_bytes: int = 2

    @property
    def expert_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers)) if self.moe_layers is None else tuple(sorted(self.moe_layers))

    def row_bytes(self) -> int:
        """Bytes of one ``I``-row (gate/up) or ``I``-column (down) of one expert projection."""
        return self.hidden * self.dtype_bytes

    def expert_layer_bytes(self) -> int:
        """Bytes of one whole expert (gate + up + down) in one layer."""
        return 3 * self.ffn_hidden * self.row_bytes()

    def total_expert_bytes(self) -> int:
        return len(self.expert_layers) * self.num_experts * self.expert_layer_bytes()


@dataclass(frozen=True, order=True)
class ExpertSlice:
    """Rows ``[lo, hi)`` along the ``I`` axis of one expert projection's HF tensor."""
    layer: int
    expert: int
    proj: str
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def hf_expert_name(layer: int, expert: int, proj: str) -> str:
    """The Hugging Face (Qwen3-MoE / Mixtral-style) parameter name of one expert projection."""
    if proj not in PROJS:
        raise LayoutError(f"unknown projection {proj!r}; expected one of {PROJS}")
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


_HF_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def parse_hf_expert_name(name: str) -> tuple[int, int, str] | None:
    m = _HF_NAME.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


# ---------------------------------------------------------------------------------------------
# training side

def _mixed_radix(rank: int, order: str, sizes: dict[str, int]) -> dict[str, int]:
    """Coordinates of ``rank`` in a grid whose axes are listed fastest-first in ``order`` --
    what Megatron-Core's ``RankGenerator`` / ``generate_masked_orthogonal_rank_groups`` compute
    (axes not named in the order must have size 1 and are appended)."""
    tokens = [t for t in order.lower().split("-") if t]
    for name, size in sizes.items():
        if name not in tokens:
            if size != 1:
                raise LayoutError(f"parallel size {name}={size} is not in the rank order {order!r}")
            tokens.append(name)
    coords = {}
    for t in tokens:
        size = sizes.get(t, 1)
        coords[t] = rank % size
        rank //= size
    return coords


@dataclass(frozen=True)
class TrainingLayout:
    """Megatron-Core parallel layout; world = tp*pp*cp*dp (the rollout shares it, colocated).

    ``layer_stages`` optionally gives the pipeline rank of every global layer (uneven first /
    last stages); without it layers are split evenly into ``pp*vpp`` chunks."""
    tp: int
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    vpp: int = 1
    expert_impl: str = "sequential"
    order: str = "tp-cp-ep-dp-pp"
    dp: int | None = None
    layer_stages: tuple[int, ...] | None = None

    def world_size(self) -> int:
        dp = 1 if self.dp is None else self.dp
        return self.tp * self.pp * self.cp * dp

    def check(self, world: int | None = None) -> int:
        """The world size, after checking the layout is one Megatron-Core accepts."""
        if self.expert_impl not in EXPERT_IMPLS:
            raise LayoutError(f"expert_impl {self.expert_impl!r} is not one of {EXPERT_IMPLS}")
        for name in ("tp", "pp", "ep", "etp", "cp", "vpp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"training {name} must be >= 1")
        world = self.world_size() if world is None else world
        if world % (self.tp * self.pp * self.cp):
            raise LayoutError(f"world {world} is not divisible by tp*pp*cp = {self.tp * self.pp * self.cp}")
        if world % (self.etp * self.ep * self.pp):
            raise LayoutError(f"world {world} is not divisible by etp*ep*pp = {self.etp * self.ep * self.pp}")
        return world

    def with_world(self, world: int) -> "TrainingLayout":
        self.check(world)
        return TrainingLayout(self.tp, self.pp, self.ep, self.etp, self.cp, self.vpp, self.expert_impl,
                              self.order, world // (self.tp * self.pp * self.cp), self.layer_stages)

    def _world(self) -> int:
        if self.dp is None:
            raise LayoutError("the training layout needs its world size: use layout.with_world(world)")
        return self.world_size()

    def coords(self, rank: int) -> dict[str, int]:
        """Megatron-Core coordinates of global ``rank``: ``tp, cp, dp, pp`` (dense grid) and
        ``etp, ep, edp`` (expert grid)."""
        world = self._world()
        dense = _mixed_radix(rank, self.order, {"tp": self.tp, "cp": self.cp, "dp": world // (self.tp * self.cp * self.pp),
                                                "pp": self.pp, "ep": 1})
        edp = world // (self.etp * self.ep * self.pp)
        expert = _mixed_radix(rank, self.order, {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": edp, "pp": self.pp})
        if expert["pp"] != dense["pp"]:
            raise LayoutError("order puts pp where the dense and expert grids disagree")
        return {"tp": dense["tp"], "cp": dense["cp"], "dp": dense["dp"], "pp": dense["pp"],
                "etp": expert["tp"], "ep": expert["ep"], "edp": expert["dp"]}

    def stage_of_layer(self, layer: int, num_layers: int) -> int:
        if self.layer_stages is not None:
            if len(self.layer_stages) != num_layers:
                raise LayoutError(f"layer_stages has {len(self.layer_stages)} entries for {num_layers} layers")
            return self.layer_stages[layer]
        chunks = self.pp * self.vpp
        if num_layers % chunks:
            raise LayoutError(f"{num_layers} layers do not split evenly into pp*vpp = {chunks} chunks "
                              "(give layer_stages for an uneven pipeline split)")
        return (layer // (num_layers // chunks)) % self.pp

    def local_experts(self, shape: MoEShape) -> int:
        if shape.num_experts % self.ep:
            raise LayoutError(f"{shape.num_experts} experts are not divisible by training ep {self.ep}")
        return shape.num_experts // self.ep

    def shard_rows(self, shape: MoEShape) -> int:
        if shape.ffn_hidden % self.etp:
            raise LayoutError(f"moe ffn hidden {shape.ffn_hidden} is not divisible by etp {self.etp}")
        return shape.ffn_hidden // self.etp

    def owned(self, shape: MoEShape, rank: int) -> list[ExpertSlice]:
        """Every expert slice rank ``rank`` holds (one per layer, expert, projection); none for a
        rank past the training world (a rollout-only rank of a checkpoint engine's group)."""
        if rank >= self._world():
            return []
        c = self.coords(rank)
        n, e_loc = self.shard_rows(shape), self.local_experts(shape)
        lo = c["etp"] * n
        return [ExpertSlice(layer, c["ep"] * e_loc + i, proj, lo, lo + n)
                for layer in shape.expert_layers if self.stage_of_layer(layer, shape.num_layers) == c["pp"]
                for i in range(e_loc) for proj in PROJS]

    def owners(self, shape: MoEShape, layer: int, expert: int, etp_rank: int) -> list[int]:
        """Global ranks holding ETP shard ``etp_rank`` of ``expert`` in ``layer`` (the expert
        data-parallel replicas), ascending."""
        stage = self.stage_of_layer(layer, shape.num_layers)
        return list(self.owner_table(shape).get((stage, expert // self.local_experts(shape), etp_rank), ()))

    def owner_table(self, shape: MoEShape) -> dict[tuple[int, int, int], tuple[int, ...]]:
        """``(pp, ep, etp) -> ranks`` for the whole world (computed once by the planner)."""
        table: dict[tuple[int, int, int], list[int]] = {}
        for r in range(self._world()):
            c = self.coords(r)
            table.setdefault((c["pp"], c["ep"], c["etp"]), []).append(r)
        return {k: tuple(v) for k, v in table.items()}


# ---------------------------------------------------------------------------------------------
# rollout side

def _linear_map(ep: int, rank: int, num_experts: int) -> tuple[int, ...]:
    base, rem = divmod(num_experts, ep)
    start = rank * base + min(rank, rem)
    return tuple(range(start, start + base + (1 if rank < rem else 0)))


PLACEMENTS = ("linear", "round_robin")  # vLLM's expert_placement_strategy values


def placement_map(placement: str, ep: int, rank: int, num_experts: int) -> tuple[int, ...]:
    """The experts rank ``rank`` of an expert-parallel group of ``ep`` vLLM workers hosts under
    vLLM's ``expert_placement_strategy`` (``linear`` or ``round_robin``), in local-slot order."""
    if placement == "linear":
        return _linear_map(ep, rank, num_experts)
    if placement == "round_robin":
        return tuple(range(rank, num_experts, ep))
    raise ValueError(f"expert_placement_strategy must be one of {PLACEMENTS}, got {placement!r}")


@dataclass(frozen=True)
class RolloutLayout:
    """vLLM layout; rollout rank = dp_rank * tp + tp_rank.

    ``first_rank`` places the rollout in the group the reshard runs over: 0 (colocated, verl
    0.6.1's hybrid engine) -- rollout rank ``r`` is the training rank ``r``, the same world; or
    the training world size (a verl 0.9 checkpoint engine's group: the trainer ranks first,
    then every rollout rank) -- rollout rank ``r`` is group rank ``first_rank + r``, and the
    trainer ranks need nothing. Every method taking a ``rank`` below takes the *group* rank."""
    tp: int
    dp: int = 1
    expert_parallel: bool = False
    expert_maps: tuple[tuple[int, ...], ...] | None = None
    first_rank: int = 0

    def group_world(self) -> int:
        """Ranks of the group the reshard runs over (trainer ranks before ``first_rank``)."""
        return self.first_rank + self.world_size()

    def training_world(self) -> int | None:
        """The training world the layout implies (None: colocated, the group's own size)."""
        return self.first_rank or None

    def _local(self, rank: int) -> int | None:
        r = rank - self.first_rank
        return r if 0 <= r < self.world_size() else None

    @classmethod
    def linear(cls, tp: int, dp: int, num_experts: int, expert_parallel: bool = True) -> "RolloutLayout":
        """vLLM's default ``linear`` placement (explicit maps, so the layout is self-describing)."""
        if not expert_parallel:
            return cls(tp, dp, False, None)
        ep = tp * dp
        return cls(tp, dp, True, tuple(_linear_map(ep, r, num_experts) for r in range(ep)))

    @classmethod
    def round_robin(cls, tp: int, dp: int, num_experts: int) -> "RolloutLayout":
        """vLLM's ``round_robin`` placement: rank r hosts experts r, r+ep, r+2ep, ..."""
        ep = tp * dp
        return cls(tp, dp, True, tuple(placement_map("round_robin", ep, r, num_experts) for r in range(ep)))

    @classmethod
    def from_expert_maps(cls, tp: int, dp: int, maps: Iterable[Iterable[int]]) -> "RolloutLayout":
        """Any placement (redundant or uneven experts): per rank, global ids in local-slot order."""
        return cls(tp, dp, True, tuple(tuple(int(e) for e in m) for m in maps))

    def world_size(self) -> int:
        return self.tp * self.dp

    def hosted(self, shape: MoEShape, rank: int) -> tuple[int, ...]:
        """Global expert ids group rank ``rank`` hosts, in local-slot order (EP only)."""
        rank = self._local(rank)
        if rank is None:
            return ()
        if not self.expert_parallel:
            return tuple(range(shape.num_experts))
        if self.expert_maps is None:
            return _linear_map(self.world_size(), rank, shape.num_experts)
        return self.expert_maps[rank]

    def check(self, shape: MoEShape) -> None:
        w = self.world_size()
        if self.tp < 1 or self.dp < 1:
            raise LayoutError("rollout tp and dp must be >= 1")
        if self.first_rank < 0:
            raise LayoutError("rollout first_rank must be >= 0")
        if not self.expert_parallel:
            if self.expert_maps is not None:
                raise LayoutError("expert_maps need expert_parallel=True")
            if shape.ffn_hidden % w:
                raise LayoutError(f"moe ffn hidden {shape.ffn_hidden} is not divisible by rollout tp*dp = {w}")
            return
        if self.expert_maps is not None:
            if len(self.expert_maps) != w:
                raise LayoutError(f"{len(self.expert_maps)} expert maps for {w} rollout ranks")
            seen = set()
            for m in self.expert_maps:
                for e in m:
                    if not 0 <= e < shape.num_experts:
                        raise LayoutError(f"expert id {e} out of range [0, {shape.num_experts})")
                    seen.add(e)
            if len(seen) != shape.num_experts:
                raise LayoutError(f"the expert maps host {len(seen)} of {shape.num_experts} experts")

    def needed_rows(self, shape: MoEShape, rank: int) -> tuple[int, int]:
        """The ``I`` interval every hosted expert projection of ``rank`` keeps."""
        if self.expert_parallel:
            return 0, shape.ffn_hidden
        n = shape.ffn_hidden // self.world_size()
        rank = self._local(rank)
        return (0, 0) if rank is None else (rank * n, (rank + 1) * n)

    def needed(self, shape: MoEShape, rank: int) -> list[tuple[ExpertSlice, int]]:
        """Every slice the rank's loader keeps, with how many local copies (redundant slots),
        in layer, expert, projection order (none for a trainer-only rank)."""
        if self._local(rank) is None:
            return []
        lo, hi = self.needed_rows(shape, rank)
        counts: dict[int, int] = {}
        for e in self.hosted(shape, rank):
            counts[e] = counts.get(e, 0) + 1
        return [(ExpertSlice(layer, e, proj, lo, hi), counts[e])
                for layer in shape.expert_layers for e in sorted(counts) for proj in PROJS]


def rollout_view(hf_tensor, proj: str, rollout: RolloutLayout, rollout_rank: int):
    """What vLLM's fused-MoE loader keeps of an HF expert tensor on ``rollout_rank``: the whole
    tensor under EP, else the flattened-TP narrow (gate/up rows, down columns)."""
    if rollout.expert_parallel:
        return hf_tensor
    dim = 1 if proj == "down_proj" else 0
    n = hf_tensor.shape[dim] // rollout.world_size()
    return hf_tensor.narrow(dim, rollout_rank * n, n)


def narrow_rows(hf_tensor, proj: str, lo: int, hi: int):
    """Rows (gate/up) or columns (down) ``[lo, hi)`` of an HF expert tensor (a view)."""
    return hf_tensor.narrow(1 if proj == "down_proj" else 0, lo, hi - lo)


def slice_shape(shape: MoEShape, proj: str, rows: int) -> tuple[int, int]:
    """HF-oriented shape of ``rows`` ``I``-rows of a projection."""
    return (shape.hidden, rows) if proj == "down_proj" else (rows, shape.hidden)


# ---------------------------------------------------------------------------------------------
# Megatron names <-> HF tensors

_MC_SEQ = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_MC_TE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.linear_fc([12])\.weight(\d+)$")
_MC_GROUPED = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.weight([12])$")


@dataclass(frozen=True)
class MegatronExpertName:
    """A parsed Megatron expert parameter name (global layer numbering)."""
    layer: int
    fc: int                      # 1 (gate|up) or 2 (down)
    local_expert: int | None     # None for GroupedMLP weight1/weight2 (all local experts)
    impl: str = field(default="sequential")


def parse_megatron_name(name: str) -> MegatronExpertName | None:
    name = name.removeprefix("module.")
    m = _MC_SEQ.match(name)
    if m:
        return MegatronExpertName(int(m.group(1)), int(m.group(3)), int(m.group(2)), "sequential")
    m = _MC_TE.match(name)
    if m:
        return MegatronExpertName(int(m.group(1)), int(m.group(2)), int(m.group(3)), "te_grouped")
    m = _MC_GROUPED.match(name)
    if m:
        return MegatronExpertName(int(m.group(1)), int(m.group(2)), None, "grouped")
    return None


def megatron_names(shape: MoEShape, training: TrainingLayout, layer: int) -> list[str]:
    """The expert parameter names of ``layer`` on one rank, for ``training.expert_impl``."""
    p = f"decoder.layers.{layer}.mlp.experts."
    e_loc = training.local_experts(shape)
    if training.expert_impl == "grouped":
        return [p + "weight1", p + "weight2"]
    if training.expert_impl == "te_grouped":
        return [p + f"linear_fc{fc}.weight{i}" for fc in (1, 2) for i in range(e_loc)]
    return [p + f"local_experts.{i}.linear_fc{fc}.weight" for fc in (1, 2) for i in range(e_loc)]


def expert_views(name: str, tensor, shape: MoEShape, training: TrainingLayout):
    """``[(local_expert, proj, hf_view)]`` of one Megatron expert parameter: each view is this
    rank's ETP shard of an HF projection, HF-oriented (``[rows, H]`` gate/up, ``[H, rows]``
    down), sharing storage with ``tensor`` (GroupedMLP views are transposed, not copied)."""
    parsed = parse_megatron_name(name)
    if parsed is None:
        raise LayoutError(f"{name!r} is not a Megatron expert parameter name")
    n, e_loc, h = training.shard_rows(shape), training.local_experts(shape), shape.hidden
    out = []
    if parsed.local_expert is not None:                       # one expert per tensor
        i, t = parsed.local_expert, tensor
        if i >= e_loc:
            raise LayoutError(f"{name}: local expert {i} but {e_loc} experts per EP rank")
        if parsed.fc == 1:
            if tuple(t.shape) != (2 * n, h):
                raise LayoutError(f"{name}: shape {tuple(t.shape)}, expected {(2 * n, h)}")
            return [(i, "gate_proj", t.narrow(0, 0, n)), (i, "up_proj", t.narrow(0, n, n))]
        if tuple(t.shape) != (h, n):
            raise LayoutError(f"{name}: shape {tuple(t.shape)}, expected {(h, n)}")
        return [(i, "down_proj", t)]
    if parsed.fc == 1:
        if tuple(tensor.shape) != (h, e_loc * 2 * n):
            raise LayoutError(f"{name}: shape {tuple(tensor.shape)}, expected {(h, e_loc * 2 * n)}")
        per = tensor.view(e_loc, h, 2 * n)
        for i in range(e_loc):
            out += [(i, "gate_proj", per[i, :, :n].t()), (i, "up_proj", per[i, :, n:].t())]
    else:
        if tuple(tensor.shape) != (e_loc * n, h):
            raise LayoutError(f"{name}: shape {tuple(tensor.shape)}, expected {(e_loc * n, h)}")
        per = tensor.view(e_loc, n, h)
        out += [(i, "down_proj", per[i].t()) for i in range(e_loc)]
    return out


def megatron_to_hf(name: str, tensor, shape: MoEShape, training: TrainingLayout, rank: int):
    """``[(hf_name, ExpertSlice, hf_view)]`` of one of ``rank``'s Megatron expert parameters:
    the HF tensor it is a shard of, which rows, and the shard as an HF-oriented view."""
    parsed = parse_megatron_name(name)
    if parsed is None:
        raise LayoutError(f"{name!r} is not a Megatron expert parameter name")
    c = training.coords(rank)
    n, e_loc = training.shard_rows(shape), training.local_experts(shape)
    lo = c["etp"] * n
    out = []
    for i, proj, view in expert_views(name, tensor, shape, training):
        e = c["ep"] * e_loc + i
        out.append((hf_expert_name(parsed.layer, e, proj), ExpertSlice(parsed.layer, e, proj, lo, lo + n), view))
    return out


def hf_to_megatron(hf: dict, shape: MoEShape, training: TrainingLayout, rank: int) -> dict:
    """The inverse: ``rank``'s Megatron expert parameters (new contiguous tensors, by
    ``training.expert_impl``) from full HF expert tensors ``{hf_name: tensor}``."""
    import torch
    c = training.coords(rank)
    n, e_loc = training.shard_rows(shape), training.local_experts(shape)
    lo = c["etp"] * n
    out = {}
    for layer in shape.expert_layers:
        if training.stage_of_layer(layer, shape.num_layers) != c["pp"]:
            continue
        shards = []
        for i in range(e_loc):
            e = c["ep"] * e_loc + i
            gate, up, down = (narrow_rows(hf[hf_expert_name(layer, e, p)], p, lo, lo + n) for p in PROJS)
            shards.append((gate, up, down))
        p = f"decoder.layers.{layer}.mlp.experts."
        if training.expert_impl == "grouped":
            out[p + "weight1"] = torch.stack([torch.cat([g, u], 0).t() for g, u, _ in shards]).reshape(shape.hidden, -1)
            out[p + "weight2"] = torch.stack([d.t() for _, _, d in shards]).reshape(-1, shape.hidden).contiguous()
        else:
            for i, (g, u, d) in enumerate(shards):
                fc1, fc2 = ((p + f"linear_fc1.weight{i}", p + f"linear_fc2.weight{i}") if training.expert_impl == "te_grouped"
                            else (p + f"local_experts.{i}.linear_fc1.weight", p + f"local_experts.{i}.linear_fc2.weight"))
                out[fc1] = torch.cat([g, u], 0).contiguous()
                out[fc2] = d.contiguous()
    return out
