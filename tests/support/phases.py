"""Where a scenario's time went, phase by phase, for its test to print (never to assert on:
this machine is shared with other jobs)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class PhaseClock:
    """``lap("start engines")`` records the seconds since the previous lap (or creation)."""

    seconds: dict[str, float] = field(default_factory=dict)
    _since: float = field(default_factory=time.perf_counter, repr=False)

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self._since, 2)
        self._since = now
