"""Double of ``mindspeed/op_builder/builder.py``: ``MindSpeedOpBuilder`` with MindSpeed's
signatures. ``load`` hands ``self.cxx_args()`` to the module-level ``load`` as ``extra_cflags``
as the real one hands it to ``torch.utils.cpp_extension.load``; here ``load`` records the call
instead of compiling (no torch_npu, no CANN)."""

import os
from abc import ABC, abstractmethod

LOAD_CALLS = []


def load(name, sources, extra_include_paths=None, extra_cflags=None, extra_ldflags=None, verbose=False):
    LOAD_CALLS.append({"name": name, "extra_cflags": list(extra_cflags or [])})
    return name


class MindSpeedOpBuilder(ABC):
    _cann_path = None
    _torch_npu_path = None
    _loaded_ops = {}

    def __init__(self, name):
        self.name = name
        self._cann_path = "/double/cann"
        self._torch_npu_path = "/double/torch_npu"

    @abstractmethod
    def sources(self):
        ...

    def include_paths(self):
        return [os.path.join(self._torch_npu_path, "include"), os.path.join(self._cann_path, "include")]

    def cxx_args(self):
        return ["-fPIC", "-O2", "-D_FORTIFY_SOURCE=2"]

    def extra_ldflags(self):
        return ["-L" + os.path.join(self._cann_path, "lib64"), "-lascendcl"]

    def load(self, verbose=True):
        if self.name in MindSpeedOpBuilder._loaded_ops:
            return MindSpeedOpBuilder._loaded_ops[self.name]
        op = load(name=self.name, sources=self.sources(), extra_include_paths=self.include_paths(),
                  extra_cflags=self.cxx_args(), extra_ldflags=self.extra_ldflags(), verbose=verbose)
        MindSpeedOpBuilder._loaded_ops[self.name] = op
        return op
