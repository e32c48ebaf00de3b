"""verl 0.6 on vLLM >= 0.13: provide the import paths verl 0.6 uses and vLLM moved.

verl 0.6.1 imports names that vLLM 0.13 moved (read in both trees, seen to fail on the recipe
stack):

* ``from vllm.lora.models import LoRAModel`` (``verl/utils/vllm/utils.py``, imported by the
  vLLM rollout and the FSDP sharding manager): the module became ``vllm.lora.lora_model``, so
  the vLLM rollout cannot even be imported. When ``vllm.lora`` is imported, ``vllm.lora.models``
  is provided as an alias module whose attributes are those of ``vllm.lora.lora_model``
  (resolved on first access: nothing is imported early).
* ``from vllm.utils import FlexibleArgumentParser, get_tcp_uri`` (the async server,
  ``vllm_async_server.py``): moved to ``vllm.utils.argparse_utils`` and
  ``vllm.utils.network_utils``. vLLM 0.13's ``vllm.utils.__getattr__`` already forwards a few
  moved names; it is wrapped to forward these two as well.

Each patch acts only where vLLM really has the new layout (checked on disk, nothing
imported), so on an older vLLM the real modules are used. README.md beside this file: why,
flags, verified where.

Remove when: running verl >= 0.9 (it imports both from their new homes).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import types

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_VERL_VLLM_COMPAT", "bool", True,
    "Let verl 0.6's vLLM rollout import on vLLM >= 0.13: provide vllm.lora.models (now "
    "vllm.lora.lora_model) and vllm.utils.FlexibleArgumentParser / get_tcp_uri (now in "
    "vllm.utils.argparse_utils / network_utils). Acts only where vLLM has the new layout.",
    feature="verl_vllm_compat")

FEATURE = Feature(
    "verl_vllm_compat", "verl 0.6's vLLM rollout imports on vLLM >= 0.13 (moved module paths).",
    flag=ENABLE, replaces="the recipe's verl patch 0017-verl-bugfix-adapt_new_vllm_version",
    verified=Verified(cpu_runtime="real verl 0.6.1 vLLM rollout and async server imported on vLLM 0.13, "
                                  "a real vLLMRollout built and generating on CPU; stock import fails"),
    stacks="recipe")

VERL_RANGE = ">=0.6,<0.9"
REMOVE_WHEN = "running verl >= 0.9, which imports these names from their new vLLM modules"

# module path verl 0.6 imports -> where vLLM >= 0.13 keeps it
LORA_ALIAS, LORA_HOME = "vllm.lora.models", "vllm.lora.lora_model"
# name verl 0.6 imports from vllm.utils -> the vllm.utils submodule that holds it now
MOVED_UTILS = {"FlexibleArgumentParser": "vllm.utils.argparse_utils",
               "get_tcp_uri": "vllm.utils.network_utils"}


def _on_disk(module: str) -> bool:
    from ...patching import static
    return static.locate_module(module) is not None


def lora_models_moved() -> bool:
    """Flag on, and vLLM has lora_model.py but no lora/models.py (read on disk, not imported)."""
    return bool(ENABLE.value) and not _on_disk(LORA_ALIAS) and _on_disk(LORA_HOME)


def utils_names_moved() -> bool:
    """Flag on, and vLLM has the utility submodules the moved names live in now."""
    return bool(ENABLE.value) and all(_on_disk(home) for home in set(MOVED_UTILS.values()))


def alias_module(name: str, home: str) -> types.ModuleType:
    """A module named ``name`` whose attributes are those of module ``home``, which is
    imported on the first attribute access (module ``__getattr__``, PEP 562)."""
    alias = types.ModuleType(name, f"ascend-rl alias of {home} (verl_vllm_compat): {name} was moved there")
    alias.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() on it must not raise

    def __getattr__(attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)  # keep module dunders (e.g. __path__) absent, as for a module file
        return getattr(importlib.import_module(home), attr)

    def __dir__():
        return sorted(set(vars(alias)) | set(dir(importlib.import_module(home))))

    alias.__getattr__ = __getattr__
    alias.__dir__ = __dir__
    alias.__ascend_rl_alias_of__ = home
    return alias


FEATURE.set(
    "vllm.lora:models", alias_module(LORA_ALIAS, LORA_HOME), create=True, rebind=False,
    name="verl_vllm_compat.lora_models_module", dist="verl", versions=VERL_RANGE,
    enabled_by=lora_models_moved,
    reason="verl 0.6's verl/utils/vllm/utils.py does `from vllm.lora.models import LoRAModel`; "
           "vLLM 0.13 moved the module to vllm.lora.lora_model, so verl's vLLM rollout fails "
           "to import",
    replaces="recipe verl 0017 (edits verl/utils/vllm/utils.py)",
    fixed_upstream="verl 0.9 (try/except over vllm.lora.lora_model and vllm.lora.models)",
    upstream="https://github.com/verl-project/verl/pull/4631",
    remove_when=REMOVE_WHEN)


@FEATURE.wrap("vllm.utils:__getattr__", name="verl_vllm_compat.utils_moved_names", dist="verl",
              versions=VERL_RANGE, enabled_by=utils_names_moved, order=50, params=("name",),
              reason="verl 0.6's vllm_async_server.py does `from vllm.utils import "
                     "FlexibleArgumentParser, get_tcp_uri`; vLLM 0.13 moved both into submodules "
                     "of vllm.utils, so verl's async (server-mode) rollout fails to import",
              fixed_upstream="verl 0.9 (imports FlexibleArgumentParser from vllm.utils.argparse_utils, "
                             "no longer uses get_tcp_uri)",
              remove_when=REMOVE_WHEN)
def _forward_moved_utils(wrapped, instance, args, kwargs):
    name = args[0] if args else kwargs.get("name")
    home = MOVED_UTILS.get(name)
    if home is None:
        return wrapped(*args, **kwargs)
    return getattr(importlib.import_module(home), name)
