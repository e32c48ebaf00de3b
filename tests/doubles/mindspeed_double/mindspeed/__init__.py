"""Test double of the ``mindspeed`` package (MindSpeed cannot be installed without CANN).

Only the modules, classes and signatures that ascend-rl's MindSpeed-facing patches touch, read
in MindSpeed at commit 028de58 (``/work/shared/reference/mindspeed-028de58``; the signatures are
compared with that source by ``tests/features/rollout_torch_compile`` and
``tests/features/mindspeed_builder_include``). The behaviour is this project's own minimal
rendering, not MindSpeed's code. Put ``tests/doubles/mindspeed_double`` on ``sys.path`` (child
processes only); the ``mindspeed-0.12.1.dist-info`` beside it makes
``importlib.metadata.version("mindspeed")`` answer as for an installed MindSpeed.
"""

IS_ASCEND_RL_DOUBLE = True
