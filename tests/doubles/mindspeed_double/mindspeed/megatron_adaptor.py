"""Double of ``mindspeed/megatron_adaptor.py``: importing it applies MindSpeed's patches, as the
real module does (``patch_features()`` at import); here only the one that matters to ascend-rl,
``torch.compile -> dummy_compile`` (registered by MindSpeed's
``RequirementsBasicFeature.te_adaptation``). ``repatch(args)`` removes and re-applies them, as
verl 0.6's Megatron worker calls it."""

from mindspeed.core.megatron_basic.requirements_basic import dummy_compile
from mindspeed.patch_utils import MindSpeedPatchesManager


def _register_and_apply():
    MindSpeedPatchesManager.register_patch("torch.compile", dummy_compile)
    MindSpeedPatchesManager.apply_patches()


def repatch(args):
    MindSpeedPatchesManager.remove_patches()
    _register_and_apply()


_register_and_apply()
