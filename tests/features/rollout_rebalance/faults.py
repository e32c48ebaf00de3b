"""Fault injection into the rebalance protocol, for scenarios run in child processes.

An :class:`Injector` wraps, in the process that installs it, the protocol's exchanges
(``protocol.all_to_all_objects``, ``protocol._from_bytes``) and one adapter class's
``extract`` / ``admit`` / ``release``, and makes exactly the chosen step fail:

* ``extract``   -- every other ``extract`` at a source raises (the request must stay there);
* ``decode``    -- the first received KV buffer cannot be decoded at a destination;
* ``meta``      -- the metadata exchange raises (on every rank that installs the injector);
* ``ack``       -- the acknowledgement exchange raises, after the destination admitted;
* ``interrupt`` -- the second admission of a round is interrupted by a ``BaseException``
  (as ``KeyboardInterrupt`` would), after the first one succeeded;
* ``release``   -- the first release of an acknowledged request raises at its source.

It counts what it did, so a test can tell that the failure hit a round that really moved
something (a destination that had admitted requests, a source that had extracted them).
"""

from __future__ import annotations

from ascend_rl_plugins.features.rollout_rebalance import protocol

KINDS = ("extract", "decode", "meta", "ack", "interrupt", "release")
_EXCHANGE = {"meta": 1, "ack": 2}  # which all_to_all_objects call of a moving round


class InjectedFault(Exception):
    """An ordinary error raised where the protocol must cope with one."""


class Interrupted(BaseException):
    """Like KeyboardInterrupt: not caught by the protocol's per-request handlers."""


class Injector:
    def __init__(self, kind: str, adapter_class: type):
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}; accepted: {', '.join(KINDS)}")
        self.kind = kind
        self.adapter_class = adapter_class
        self.inside = False
        self.exchanges = 0  # all_to_all_objects calls in the current round
        self.admitted = 0  # successful admissions in the current round
        self.admitted_at_fire: int | None = None
        self.fired = 0
        self.extracts = 0
        self.failed_extracts: list[str] = []
        self.failed_release: str | None = None

    def report(self) -> dict:
        return {"kind": self.kind, "fired": self.fired, "admitted_at_fire": self.admitted_at_fire,
                "failed_extracts": self.failed_extracts, "failed_release": self.failed_release}

    def _fire(self, what: str):
        self.fired += 1
        self.admitted_at_fire = self.admitted
        return InjectedFault(f"injected fault: {what}")

    def install(self) -> "Injector":
        cls = self.adapter_class
        self._saved = [(protocol, name, getattr(protocol, name))
                       for name in ("rebalance_round", "all_to_all_objects", "_from_bytes")]
        self._saved += [(cls, name, cls.__dict__[name]) for name in ("extract", "admit", "release")]
        original_round = protocol.rebalance_round

        def rebalance_round(*args, **kwargs):
            self.inside, self.exchanges, self.admitted = True, 0, 0
            try:
                return original_round(*args, **kwargs)
            finally:
                self.inside = False
        protocol.rebalance_round = rebalance_round

        original_exchange = protocol.all_to_all_objects

        def all_to_all_objects(per_rank, group):
            if self.inside:
                self.exchanges += 1
                if not self.fired and _EXCHANGE.get(self.kind) == self.exchanges:
                    raise self._fire(f"the {self.kind} exchange raised")
            return original_exchange(per_rank, group)
        protocol.all_to_all_objects = all_to_all_objects

        original_decode = protocol._from_bytes

        def from_bytes(buf, dtype_name, shape):
            if self.kind == "decode" and not self.fired:
                raise self._fire("a received KV buffer could not be decoded")
            return original_decode(buf, dtype_name, shape)
        protocol._from_bytes = from_bytes

        extract, admit, release = cls.extract, cls.admit, cls.release

        def faulty_extract(adapter, migration):
            self.extracts += 1
            if self.kind == "extract" and self.extracts % 2:
                self.fired += 1
                self.failed_extracts.append(migration.request_id)
                raise InjectedFault(f"injected fault: extract {migration.request_id}")
            return extract(adapter, migration)

        def faulty_admit(adapter, meta, kv):
            if self.kind == "interrupt" and not self.fired and self.admitted == 1:
                self.fired += 1
                self.admitted_at_fire = self.admitted
                raise Interrupted("injected interrupt in the admission loop")
            ok = admit(adapter, meta, kv)
            self.admitted += bool(ok)
            return ok

        def faulty_release(adapter, meta):
            if self.kind == "release" and not self.fired:
                self.fired += 1
                self.failed_release = meta["_id"]
                raise InjectedFault(f"injected fault: release {meta['_id']}")
            return release(adapter, meta)
        cls.extract, cls.admit, cls.release = faulty_extract, faulty_admit, faulty_release
        return self

    def uninstall(self) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)
