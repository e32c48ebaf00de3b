"""Double of ``mindspeed.core.context_parallel`` (a package in MindSpeed; its real ``__init__``
pulls in Megatron's ``get_args``, which the double does not need)."""
