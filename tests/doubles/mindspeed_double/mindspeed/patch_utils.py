"""Double of ``mindspeed/patch_utils.py``: MindSpeed's patch record and patch manager.

Names, signatures and the attributes other code reads (``patches_info``; on a record
``orig_func``, ``final_patch_func``, ``patch_func``, ``is_applied``) are MindSpeed's; the
behaviour is reduced to what the tests need: install a replacement under a dotted name, in its
module and in every module holding the original under the same attribute name, and take it
away again.
"""

import importlib
import sys
from typing import Dict


class Patch:
    def __init__(self, orig_func_name, new_func, create_dummy):
        self.orig_module_name, _, self.orig_func_name = orig_func_name.rpartition(".")
        self.orig_module = None
        self.orig_func = None
        self.patch_func = None
        self.final_patch_func = None
        self.wrappers = []
        self.create_dummy = create_dummy
        self.is_applied = False
        self.set_patch_func(new_func)

    def set_patch_func(self, new_func, force_patch=False):
        name = getattr(new_func, "__name__", "")
        if name.endswith(("wrapper", "decorator")):
            self.wrappers.append(new_func)
        else:
            if self.patch_func is not None and not force_patch:
                raise RuntimeError(f"the patch of {self.orig_func_name} exists")
            self.patch_func = new_func
        self.is_applied = False

    def _rebind(self, old, new, skip_mindspeed):
        for key, module in list(sys.modules.items()):
            if skip_mindspeed and "mindspeed" in key:
                continue
            try:
                found = getattr(module, self.orig_func_name, None)
            except Exception:  # lazy modules (transformers 5) import on attribute access and may
                continue       # raise ModuleNotFoundError here (no torchvision in the test venvs)
            if found is old:
                setattr(module, self.orig_func_name, new)

    def apply_patch(self):
        if self.is_applied:
            return
        module = importlib.import_module(self.orig_module_name)
        current = getattr(module, self.orig_func_name)
        if self.orig_module is None:
            self.orig_module, self.orig_func = module, current
        final = self.patch_func if self.patch_func is not None else self.orig_func
        for wrapper in self.wrappers:
            final = wrapper(final)
        setattr(module, self.orig_func_name, final)
        self._rebind(current, final, skip_mindspeed=False)
        self.final_patch_func = final
        self.is_applied = True

    def remove_patch(self):
        if self.final_patch_func is not None:
            self._rebind(self.final_patch_func, self.orig_func, skip_mindspeed=True)
        self.patch_func = None
        self.final_patch_func = None
        self.is_applied = False


class MindSpeedPatchesManager:
    patches_info: Dict[str, Patch] = {}

    @staticmethod
    def register_patch(orig_func_name, new_func=None, force_patch=False, create_dummy=False):
        record = MindSpeedPatchesManager.patches_info.get(orig_func_name)
        if record is None:
            MindSpeedPatchesManager.patches_info[orig_func_name] = Patch(orig_func_name, new_func, create_dummy)
        else:
            record.set_patch_func(new_func, force_patch)

    @staticmethod
    def remove_patches():
        for record in MindSpeedPatchesManager.patches_info.values():
            record.remove_patch()
            record.wrappers.clear()

    @staticmethod
    def apply_patches():
        for record in MindSpeedPatchesManager.patches_info.values():
            record.apply_patch()
