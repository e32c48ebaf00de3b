"""Child-process scenario of ``test_activation.py``: verl's own mechanism loads ascend-rl and
the verl patches of data_rebalance, dataproto_timing_merge and onpolicy_old_logprob land on
the modules verl imports (run by ``tests.support.child.run_scenario``, never imported by the
pytest process). The environment chooses the mechanism and switches the features on."""

from __future__ import annotations

import importlib
import os
import sys

MODULES = ("verl.trainer.main_ppo", "verl.single_controller.ray.base", "verl.protocol", "verl.utils.config")
OPTIONAL = ("verl.workers.actor.megatron_actor",)  # absent in verl 0.9


def activate() -> dict:
    os.environ.pop("ASCEND_RL_AUTOLOAD", None)
    assert "ascend_rl_plugins" not in sys.modules
    import verl
    for name in MODULES + OPTIONAL:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            assert name in OPTIONAL, name
    import ascend_rl_plugins
    main_ppo = sys.modules["verl.trainer.main_ppo"]
    from verl.utils import config as verl_config
    states = {s["patch"]: [s["state"], s["reason"]] for s in ascend_rl_plugins.status()
              if s["feature"] in ("data_rebalance", "dataproto_timing_merge", "onpolicy_old_logprob")}
    return {"verl": verl.__version__, "activated_by": ascend_rl_plugins.plugin.activated_by(), "states": states,
            # main_ppo's `from verl.utils.config import validate_config` copy is the patched one
            "main_ppo_copy_patched": main_ppo.validate_config is verl_config.validate_config
            and hasattr(verl_config.validate_config, "__wrapped__")}
