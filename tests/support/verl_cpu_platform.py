"""A CPU device platform for verl 0.9 (test support; a double of a platform verl does not ship).

verl 0.9 reaches its accelerator through ``verl.plugin.platform`` (``get_torch_device()``,
``get_device_id()``, ...) and registers CUDA, NPU and ROCm platforms only; on a machine with
none it falls back to CUDA, whose calls then fail. :func:`install` sets a platform that
answers for the host: device ``"cpu"``, gloo, no IPC, no-op synchronize / seed / cache calls.
``device_module`` (what ``get_torch_device()`` returns) defaults to :data:`HOST_DEVICE`, the
``torch.cuda`` functions verl calls on its way (cache, IPC, memory figures), answered for host
memory (verl 0.9.1's memory logs then read 0 GB); a scenario may pass its own.
"""

from __future__ import annotations

import types

HOST_DEVICE = types.SimpleNamespace(
    synchronize=lambda *a: None, empty_cache=lambda: None, ipc_collect=lambda: None,
    current_device=lambda: "cpu", device_count=lambda: 1, is_available=lambda: True,
    memory_allocated=lambda *a: 0, memory_reserved=lambda *a: 0, max_memory_allocated=lambda *a: 0,
    mem_get_info=lambda *a: (0, 0), manual_seed=lambda seed: None, manual_seed_all=lambda seed: None)


def install(device_module=None, current_device="cpu") -> None:
    """Make verl's ``get_platform()`` return the CPU platform in this process."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import set_platform

    module = HOST_DEVICE if device_module is None else device_module

    class CpuPlatformDouble(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = module

        def is_available(self): return True
        def current_device(self): return current_device
        def device_count(self): return 1
        def set_device(self, device_index): pass
        def synchronize(self, device_index=None): pass
        def manual_seed(self, seed): pass
        def manual_seed_all(self, seed): pass
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def get_device_capability(self, device_index=0): return (None, None)
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CPU_VISIBLE_DEVICES"
        def nvtx_range(self, msg): return None
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

    for name in [n for n, v in vars(PlatformBase).items() if getattr(v, "__isabstractmethod__", False)]:
        if name not in vars(CpuPlatformDouble):  # properties in some versions
            setattr(CpuPlatformDouble, name, lambda self, *a, **k: None)
    CpuPlatformDouble.__abstractmethods__ = frozenset()
    set_platform(CpuPlatformDouble())
