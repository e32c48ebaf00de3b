"""A ``torch.npu`` double for verl 0.6's hybrid-engine mode switches (torch_npu cannot be
installed without CANN).

Only what verl's ``rollout_mode`` / ``trainer_mode`` call on the device module
(``verl.utils.device.get_torch_device()``): availability, memory counters (all zero), cache
release and synchronisation (no-ops), the RNG state (torch's CPU generator), and
``memory._set_allocator_settings``, which records its argument in ``events``: the call verl
0.9 makes on NPU (``verl/plugin/platform/platform_npu.py``) and this feature adds to verl 0.6.
"""

from __future__ import annotations

import types


class TorchNpuDouble:
    def __init__(self, events: list):
        self.events = events
        self.memory = types.SimpleNamespace(_set_allocator_settings=self._set_allocator_settings)

    def _set_allocator_settings(self, settings: str) -> None:
        self.events.append(["npu allocator", settings])

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def memory_allocated() -> int:
        return 0

    @staticmethod
    def memory_reserved() -> int:
        return 0

    @staticmethod
    def mem_get_info() -> tuple[int, int]:
        return 0, 0

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize() -> None:
        pass

    @staticmethod
    def get_rng_state():
        import torch
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state) -> None:
        import torch
        torch.set_rng_state(state)
