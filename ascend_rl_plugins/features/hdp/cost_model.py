"""Cost model of one training micro-batch under context parallelism (CP) or hybrid data
parallelism inside the CP group (HDP).

Why a model at all: the seed's HDP grouping (verl patches 0010/0015) counts tokens only, so it
cannot see that attention is quadratic, that ring-attention communication is hidden behind
attention compute once a rank's chunk is long enough, or that every extra micro-batch costs a
fixed overhead. Deciding whether a micro-batch runs faster as plain CP or as regrouped ranks
needs all of those, in seconds, on the user's hardware. The planner (``planner.py``) asks this
model only for per-sequence per-rank times, so a better calibration improves every plan
without touching the planner.

The model, for a *pack* of sequences of lengths ``L_i`` that a group of ``g`` ranks computes
in one micro-batch at tensor parallel size ``tp`` (everything is per rank, for the layers one
pipeline stage holds, forward plus backward):

- padding: each sequence is padded to a multiple of ``2*g*tp`` when ``g > 1`` (Megatron's
  load-balanced CP split into ``2*g`` chunks, each divisible by ``tp`` for sequence
  parallelism; this is verl's ``align_size``) and of ``tp`` when ``g == 1``. ``P_i`` is the
  padded length, ``n_i = P_i / g`` the tokens this rank computes of it, ``N = sum n_i``;
- linear work (projections, MLP/MoE, norms): ``linear_per_token * N``;
- attention: causal, load balanced, so each rank computes ``P_i**2 / (2*g)`` query-key pairs
  of every sequence, ``A = attention_per_token_pair * sum P_i**2 / (2*g)`` seconds;
- ring communication (``g > 1``), *as a packed (THD) ring runs*: ``g - 1`` steps; in each
  step every rank sends ONE message, the K/V of its chunks of all the pack's sequences
  (``kv_bytes_per_token * N`` bytes over ``link_bytes_per_s``, plus ONE
  ``ring_step_latency``), while it computes that step's attention over all the pack's
  sequences (``A / g``); only the part of a step's transfer longer than that compute is
  exposed: ``(g - 1) * max(0, ring_step_latency + kv_bytes_per_token * N / link_bytes_per_s
  - A / g)``. A long sequence's attention thus hides the short ones' transfer, and a pack
  pays one latency per step, not one per sequence;
- ``per_micro_batch_overhead``: fixed cost of every micro-batch (kernel launches, pipeline
  fill/drain share, synchronization).

A group's time is :meth:`CostModel.group_time` (the pack formula above); a micro-batch takes
as long as its slowest group plus the overhead. A single sequence is a pack of one
(:meth:`CostModel.sequence_times`). For comparison only, ``ring="sequence"`` prices the ring
per sequence and sums over the pack (one latency per sequence per step, no hiding across
sequences): the model this package used before, which is never cheaper than the pack model
and overstates what regrouping saves.

The pack time is ``W + (g - 1) * max(0, ring_step_latency + X)`` with ``W = sum w_i`` and
``X = sum x_i`` sums of per-sequence terms (``w_i`` = linear plus attention seconds, ``x_i``
= transfer seconds minus one step's attention, :meth:`CostModel.pack_terms`), so the planner
accumulates two numbers per group. Adding a sequence to a pack never makes it faster
(``w_i - (g - 1) * attention_i / g > 0``).

No torch here: the planner must run anywhere (it is pure numpy).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Sequence

import numpy as np

DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_cost_model.json")

RING_PRICING = ("pack", "sequence")  # how ring communication is priced (see the docstring)

_NUMERIC_FIELDS = ("linear_per_token", "attention_per_token_pair", "kv_bytes_per_token",
                   "link_bytes_per_s", "ring_step_latency", "per_micro_batch_overhead",
                   "relative_error")


def pad_multiple(group_size: int, tp: int) -> int:
    """What a sequence is padded to on a group of ``group_size`` ranks: verl's ``align_size``
    (``2*cp*tp`` under CP, ``tp`` without), so that Megatron can cut it into ``2*g`` equal
    chunks that tensor/sequence parallelism splits again by ``tp``."""
    return 2 * group_size * tp if group_size > 1 else tp


def padded_length(length, group_size: int, tp: int):
    """``length`` rounded up to :func:`pad_multiple` (works on ints and integer arrays)."""
    m = pad_multiple(group_size, tp)
    return -(-length // m) * m


@dataclass(frozen=True)
class CostModel:
    """Seconds per rank for the layers of one pipeline stage, forward plus backward.

    See the module docstring for the formula. Construct with :meth:`load` (a calibrated JSON)
    or :meth:`from_architecture` (first-principles numbers: an uncalibrated starting point).
    """

    linear_per_token: float  # s per token a rank computes (all non-attention work)
    attention_per_token_pair: float  # s per causal query-key pair a rank computes
    kv_bytes_per_token: float  # bytes one ring step moves per token of the rank's chunk
    link_bytes_per_s: float  # point-to-point bandwidth of one ring step
    ring_step_latency: float = 0.0  # s of fixed cost per ring step (all layers)
    per_micro_batch_overhead: float = 0.0  # s per micro-batch
    # the model's relative error on measured micro-batch times (calibration writes it): the
    # planner regroups only where the modelled gain over plain CP exceeds it
    relative_error: float = 0.0
    # measured ring numbers per group size ("2", "3", ...: {"ring_step_latency": s,
    # "link_bytes_per_s": B/s}); a size not listed uses the two fields above
    ring_by_group_size: dict = field(default_factory=dict)
    calibrated: bool = False  # True only in a file `ascend-rl hdp calibrate` wrote
    comment: str = ""

    def __post_init__(self) -> None:
        for name in _NUMERIC_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"CostModel.{name}={value!r}: expected a finite number "
                                 f"(accepted: a float >= 0; link_bytes_per_s > 0)")
            object.__setattr__(self, name, float(value))
            if value < 0 or (name == "link_bytes_per_s" and value <= 0) \
                    or (name == "relative_error" and value >= 1):
                raise ValueError(f"CostModel.{name}={value!r}: expected a float >= 0 "
                                 f"(link_bytes_per_s must be > 0, relative_error < 1)")
        if not isinstance(self.comment, str):
            raise ValueError(f"CostModel.comment={self.comment!r}: expected a string")
        if not isinstance(self.calibrated, bool):
            raise ValueError(f"CostModel.calibrated={self.calibrated!r}: expected true or false")
        if not isinstance(self.ring_by_group_size, dict):
            raise ValueError(f"CostModel.ring_by_group_size={self.ring_by_group_size!r}: expected an "
                             f"object of group size -> {{ring_step_latency, link_bytes_per_s}}")
        ring = {}
        for size, entry in self.ring_by_group_size.items():
            where = f"CostModel.ring_by_group_size[{size!r}]"
            if not str(size).isdigit() or int(size) < 2:
                raise ValueError(f"{where}: the key must be a group size >= 2")
            if not isinstance(entry, dict) or set(entry) != {"ring_step_latency", "link_bytes_per_s"}:
                raise ValueError(f"{where}={entry!r}: expected exactly ring_step_latency and "
                                 f"link_bytes_per_s")
            latency, bandwidth = entry["ring_step_latency"], entry["link_bytes_per_s"]
            for name, value in (("ring_step_latency", latency), ("link_bytes_per_s", bandwidth)):
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not math.isfinite(value) or value < 0 \
                        or (name == "link_bytes_per_s" and value <= 0):
                    raise ValueError(f"{where}.{name}={value!r}: expected a finite float >= 0 "
                                     f"(link_bytes_per_s > 0)")
            ring[str(int(size))] = {"ring_step_latency": float(latency),
                                    "link_bytes_per_s": float(bandwidth)}
        object.__setattr__(self, "ring_by_group_size", ring)

    def __hash__(self) -> int:  # a dict field: hash what identifies the model
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def ring(self, group_size: int) -> tuple[float, float]:
        """(ring step latency, link bytes per second) for a group of ``group_size`` ranks."""
        entry = self.ring_by_group_size.get(str(int(group_size)))
        if entry is None:
            return self.ring_step_latency, self.link_bytes_per_s
        return entry["ring_step_latency"], entry["link_bytes_per_s"]

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        """Build from a mapping; unknown or missing fields are a ``ValueError`` naming them."""
        if not isinstance(data, dict):
            raise ValueError(f"cost model: expected a JSON object with fields "
                             f"{', '.join(_NUMERIC_FIELDS)} (and optional 'comment'), "
                             f"got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        extra = sorted(set(data) - known)
        if extra:
            raise ValueError(f"cost model: unknown field(s) {extra}; accepted fields: "
                             f"{sorted(known)}")
        missing = [n for n in ("linear_per_token", "attention_per_token_pair",
                               "kv_bytes_per_token", "link_bytes_per_s") if n not in data]
        if missing:
            raise ValueError(f"cost model: missing field(s) {missing}; required: "
                             f"linear_per_token, attention_per_token_pair, kv_bytes_per_token, "
                             f"link_bytes_per_s")
        return cls(**data)

    @classmethod
    def load(cls, path: str | None = None) -> "CostModel":
        """Read a calibrated model from ``path`` (``None``: the shipped, uncalibrated default).

        A file that is not JSON, or has unknown, missing or invalid fields, is a ``ValueError``
        that names the file, the field and what is accepted."""
        path = DEFAULT_PATH if path is None else os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost model {path}: not valid JSON ({exc})") from None
        except OSError as exc:
            raise ValueError(f"cost model {path}: cannot read it ({exc.strerror})") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"cost model {path}: {exc}") from None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_architecture(cls, *, active_params: float, num_layers: int, num_q_heads: int,
                          qk_head_dim: int, v_head_dim: int, num_kv_heads: int, tp: int,
                          pp: int, matmul_flops_per_s: float, attention_flops_per_s: float,
                          link_bytes_per_s: float, step_latency_per_layer: float,
                          per_micro_batch_overhead: float, bytes_per_element: int = 2,
                          comment: str = "") -> "CostModel":
        """First-principles numbers for a model and a device (uncalibrated: efficiencies are
        guesses). Assumptions, all per rank of one pipeline stage:

        - linear: 6 FLOPs per active parameter per token (2 forward, 4 backward), split over
          ``tp * pp`` ranks;
        - attention: forward ``2*(qk_head_dim + v_head_dim)`` FLOPs per head per query-key
          pair (QK^T and PV), backward 2.5x forward (flash-attention recomputes scores);
        - ring: forward sends K and V of the chunk; backward sends K, V and dK, dV: 3x the
          forward bytes. Two rings (forward, backward) pay the step latency per layer.
          For MLA in training K/V are materialized per head, so pass ``num_kv_heads =
          num_q_heads`` and the full K (nope + rope) dim as ``qk_head_dim``.
        """
        layers = num_layers / pp
        linear = 6.0 * active_params / (tp * pp) / matmul_flops_per_s
        pair_flops = 2.0 * (qk_head_dim + v_head_dim) * num_q_heads / tp * 3.5 * layers
        kv_bytes = (num_kv_heads * (qk_head_dim + v_head_dim) / tp * bytes_per_element
                    * 3.0 * layers)
        return cls(linear_per_token=linear,
                   attention_per_token_pair=pair_flops / attention_flops_per_s,
                   kv_bytes_per_token=kv_bytes, link_bytes_per_s=link_bytes_per_s,
                   ring_step_latency=2.0 * step_latency_per_layer * layers,
                   per_micro_batch_overhead=per_micro_batch_overhead, comment=comment)

    # -- evaluation --------------------------------------------------------------------------

    def pack_terms(self, lengths, group_size: int, *, tp: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-sequence additive terms of the pack formula on ``group_size`` ranks (vectorized,
        float64): ``work`` (linear plus attention seconds) and ``exposed`` (one ring step's
        K/V transfer seconds minus that step's attention; zeros when ``group_size == 1``).
        A pack takes ``sum(work) + (g - 1) * max(0, ring_step_latency + sum(exposed))``."""
        g = int(group_size)
        lengths = np.asarray(lengths, dtype=np.int64)
        p = padded_length(lengths, g, tp).astype(np.float64)
        n = p / g
        attention = self.attention_per_token_pair * (p * p) / (2.0 * g)
        work = self.linear_per_token * n + attention
        if g == 1:
            return work, np.zeros_like(work)
        bandwidth = self.ring(g)[1]
        return work, self.kv_bytes_per_token * n / bandwidth - attention / g

    def pack_time_from_terms(self, work_sum: float, exposed_sum: float, group_size: int
                             ) -> float:
        """Per-rank seconds of a pack from the sums of :meth:`pack_terms`."""
        if group_size <= 1:
            return float(work_sum)
        return float(work_sum + (group_size - 1) * max(0.0, self.ring(group_size)[0]
                                                       + exposed_sum))

    def sequence_times(self, lengths, group_size: int, *, tp: int, with_comm: bool = True
                       ) -> np.ndarray:
        """Per-rank seconds of each sequence of ``lengths`` run alone (a pack of one) on
        ``group_size`` ranks (vectorized; float64). ``with_comm=False`` leaves out ring
        communication (used for lower bounds)."""
        g = int(group_size)
        work, exposed = self.pack_terms(lengths, g, tp=tp)
        if g > 1 and with_comm:
            return work + (g - 1) * np.maximum(0.0, self.ring(g)[0] + exposed)
        return work

    def sequence_time(self, length: int, group_size: int, *, tp: int) -> float:
        """Per-rank seconds of one sequence on ``group_size`` ranks."""
        return float(self.sequence_times([length], group_size, tp=tp)[0])

    def group_time(self, lengths_in_group: Sequence[int], group_size: int, *, tp: int,
                   ring: str = "pack") -> float:
        """Per-rank seconds of a group of ``group_size`` ranks running ``lengths_in_group``
        packed in one micro-batch. Overhead excluded. ``ring="pack"`` (the runtime's ring:
        one K/V exchange per step for the whole pack); ``ring="sequence"``: the per-sequence
        pricing, the sum of each sequence's time alone (for comparison)."""
        if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) \
                or group_size < 1:
            raise ValueError(f"group_size={group_size!r}: expected an integer >= 1")
        if ring not in RING_PRICING:
            raise ValueError(f"ring={ring!r}: accepted values are "
                             f"{', '.join(map(repr, RING_PRICING))}")
        if len(lengths_in_group) == 0:
            return 0.0
        if ring == "sequence":
            return math.fsum(self.sequence_times(lengths_in_group, group_size, tp=tp).tolist())
        work, exposed = self.pack_terms(lengths_in_group, group_size, tp=tp)
        return self.pack_time_from_terms(math.fsum(work.tolist()), math.fsum(exposed.tolist()),
                                         int(group_size))

    def micro_batch_time(self, groups: Sequence[tuple[Sequence[int], int]], *, tp: int,
                         ring: str = "pack") -> float:
        """Seconds of one micro-batch: its slowest group (``(lengths, group_size)`` pairs)
        plus the per-micro-batch overhead."""
        slowest = max((self.group_time(ls, g, tp=tp, ring=ring) for ls, g in groups),
                      default=0.0)
        return slowest + self.per_micro_batch_overhead
