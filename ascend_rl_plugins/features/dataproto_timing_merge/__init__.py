"""DataProto timing merge: ``DataProto.concat`` no longer fails on per-worker ``timing``.

verl's ``DataProto.concat`` (a staticmethod; verl 0.6.1 and 0.9.1 alike) merges the chunks'
``meta_info`` and asserts that every key other than ``metrics`` has one value across chunks.
Rollout workers report ``meta_info["timing"]`` as an all-reduced mean that can differ in the
last float bits from rank to rank, so collecting their outputs aborts a run. The wrapper takes
``timing`` out of the chunks, lets the original concatenate (its strict check stays for every
other key) and puts back one ``timing`` dict merged key by key with ``max`` (the slowest worker
is the step's wall time). A ``timing`` that is not a dict of numbers is left to the original,
whose check then fires as before. README.md beside this file: why, flags, verified where.

Remove when: verl merges or tolerates per-worker ``timing`` in ``DataProto.concat``
(verl-project/verl#4030, open).
"""

from __future__ import annotations

from numbers import Real

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_DATAPROTO_TIMING_MERGE", "bool", True,
    "DataProto.concat merges the chunks' meta_info['timing'] dicts (max per key) instead of "
    "asserting they are equal; every other meta_info key keeps verl's strict check.",
    feature="dataproto_timing_merge")

FEATURE = Feature(
    "dataproto_timing_merge", "DataProto.concat merges per-worker timing (max per key); strict elsewhere.",
    flag=ENABLE, replaces="the recipe's verl patch 0013-verl-bugfix-dataProto_concat",
    verified=Verified(cpu_runtime="real DataProto.concat (verl 0.6.1 and 0.9.1), directly and through "
                                  "verl's collect path (_concat_data_proto_or_future)"),
    stacks="recipe, current")

TIMING = "timing"


def merge_timings(timings: list) -> dict | None:
    """One ``timing`` dict from several: every key of any chunk, the largest value of the
    chunks that have it. None when a value is not a real number (bools excluded): then the
    caller leaves the chunks to verl's strict check."""
    merged: dict = {}
    for timing in timings:
        if not isinstance(timing, dict):
            return None
        for key, value in timing.items():
            if isinstance(value, bool) or not isinstance(value, Real):
                return None
            merged[key] = value if key not in merged else max(merged[key], value)
    return merged


def _without_timing(chunk):
    """A shallow copy of a DataProto whose meta_info lacks ``timing``. Built without
    ``__init__`` (no consistency check, no copy of tensors) and without ``copy.copy``
    (DataProto's pickling hooks serialize the whole batch)."""
    clone = object.__new__(type(chunk))
    clone.__dict__.update(chunk.__dict__)
    clone.meta_info = {k: v for k, v in chunk.meta_info.items() if k != TIMING}
    return clone


def _data_argument(args, kwargs):
    return args[0] if args else kwargs.get("data")


@FEATURE.wrap("verl.protocol:DataProto.concat", dist="verl", versions=">=0.6,<0.10", order=50,
              params=("data",), name="dataproto_timing_merge.concat",
              reason="DataProto.concat asserts that every chunk's meta_info['timing'] is equal; "
                     "rollout workers' all-reduced timings differ in the last float bits, which "
                     "aborts collecting their outputs",
              replaces="recipe verl patch 0013 (10% tolerance on generate_sequences only)",
              upstream="https://github.com/verl-project/verl/pull/4030",
              remove_when="verl merges or tolerates per-worker meta_info['timing'] in "
                          "DataProto.concat (verl-project/verl#4030)")
def _concat(wrapped, instance, args, kwargs):
    data = _data_argument(args, kwargs)
    if not isinstance(data, (list, tuple)) or len(data) < 2:
        return wrapped(*args, **kwargs)
    timings = [d.meta_info[TIMING] for d in data if TIMING in d.meta_info]
    if len(timings) < 2 or all(t == timings[0] for t in timings[1:]):
        return wrapped(*args, **kwargs)  # nothing to merge: verl's own path, untouched
    merged = merge_timings(timings)
    if merged is None:
        return wrapped(*args, **kwargs)  # not a dict of numbers: verl's strict check decides
    out = wrapped([_without_timing(d) for d in data])
    out.meta_info[TIMING] = merged
    return out
