"""Double of ``mindspeed/core/megatron_basic/requirements_basic.py``: ``dummy_compile``, the
function MindSpeed installs as ``torch.compile`` (compiles nothing; used as ``compile(fn)`` or
as ``@compile(...)``)."""


def dummy_compile(*args, **kwargs):
    if args and callable(args[0]):
        fn = args[0]

        def uncompiled(*fn_args, **fn_kwargs):
            return fn(*fn_args, **fn_kwargs)
        return uncompiled

    def decorator(fn):
        return dummy_compile(fn)
    return decorator
