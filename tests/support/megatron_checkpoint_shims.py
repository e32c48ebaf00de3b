"""What a real Megatron-Core ``DistributedOptimizer`` and ``dist_checkpointing`` need on this
CPU machine beyond the harness (tests/support/megatron.py): test shims, each documented like
those of tests/support/megatron_shims.py, and a double of MindSpeed's swap AdamW. Test support
only, imported by the scenario modules of tests/features/optimizer_state_none and
tests/features/dist_ckpt_expert_reload; the model-level shims are in megatron_shims.py.

Shims (none changes a value; each is installed only where the running stack needs it):

1. ``cuda_literals_on_cpu``     (context manager) ``device='cuda'`` literals -> CPU, ``Tensor.cuda()``
                                -> the tensor, ``Tensor.type()`` answers the ``torch.cuda.*`` name
2. ``cuda_synchronize``         ``torch.cuda.synchronize`` -> no-op
3. ``fp8_quantize_without_te``  0.12.1 without TE: ``quantize_param_shard`` with no FP8 parameter -> no-op
4. ``write_item_format``        0.12.1 + torch >= 2.9: ``_write_item`` gets ``serialization_format``
5. ``mcore_metadata_kept``      0.12.1 + torch >= 2.9: checkpoint metadata keeps ``mcore_data``
6. ``numpy_product``            0.12.1 + NumPy 2: ``numpy.product`` -> ``numpy.prod``

Double: ``swap_adamw_double()`` (a class ``SwapAdamWDouble``), bound where Megatron-Core's optimizer
modules bind Apex's ``FusedAdam`` -- MindSpeed registers its AdamW as ``apex.optimizers.FusedAdam``
on an NPU (``features_manager/megatron_basic/requirements_basic.py``), so Megatron-Core takes its
Apex branch there, as it does here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

_installed: list[str] = []


# --- the MindSpeed swap-optimizer double -----------------------------------------------------

SWAP_ADAMW_DOC = """Double of MindSpeed's AdamW as its swap optimizer runs it (``--swap-optimizer``, which the
    recipe's Qwen3-235B scripts switch on), MindSpeed 028de58:

    - the step counter lives in the param group (``group['step']``), none per parameter
      (``core/optimizer/adamw.py`` ``AdamW.step``; ``swap_optimizer.py`` ``swap_adamw_step``);
    - a parameter's state is ``exp_avg``, ``exp_avg_sq`` and ``max_exp_avg_sq``, the latter
      ``None`` when AMSGrad is off (``swap_optimizer.py``: ``init_param_opt_state`` and
      ``swap_adamw_step``, "... if amsgrad else None");
    - decoupled weight decay (AdamW).

    The update is plain AdamW in the parameters' dtype (no swapping: host memory is the device
    here)."""

_CLASS: list = []


def swap_adamw_double():
    """The double's class (a ``torch.optim.Optimizer``; built on first use, torch imports lazily)."""
    if _CLASS:
        return _CLASS[0]
    import torch

    class SwapAdamWDouble(torch.optim.Optimizer):
        __doc__ = SWAP_ADAMW_DOC

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                     **unused):  # Megatron-Core 0.16 passes adam_w_mode= to an Apex optimizer
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                          amsgrad=amsgrad))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                beta1, beta2 = group["betas"]
                bias1, bias2 = 1 - beta1 ** group["step"], 1 - beta2 ** group["step"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if len(state) == 0:
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    if "max_exp_avg_sq" not in state:
                        state["max_exp_avg_sq"] = torch.zeros_like(p) if group["amsgrad"] else None
                    grad = p.grad
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    second = state["exp_avg_sq"]
                    if group["amsgrad"]:
                        torch.maximum(state["max_exp_avg_sq"], second, out=state["max_exp_avg_sq"])
                        second = state["max_exp_avg_sq"]
                    denom = (second / bias2).sqrt_().add_(group["eps"])
                    p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias1)
            return None

    _CLASS.append(SwapAdamWDouble)
    return SwapAdamWDouble


def install_mindspeed_optimizer_double() -> None:
    """Megatron-Core's optimizer modules take their Apex branch with the double as Apex's
    ``FusedAdam``: what their import-time ``from apex.optimizers import FusedAdam as Adam`` binds
    on an NPU, where MindSpeed registers its AdamW under that name (and torch's SGD as
    ``FusedSGD``). Set on the imported modules rather than through a dummy ``apex`` package,
    which would also turn the harness's norms into Apex's (``import apex`` is their test)."""
    import torch
    from megatron.core import optimizer as package
    from megatron.core.optimizer import distrib_optimizer
    choices = {package: {"Adam": swap_adamw_double(), "SGD": torch.optim.SGD, "USING_PYTORCH_OPTIMIZER": False},
               distrib_optimizer: {"Adam": swap_adamw_double(), "HAVE_APEX_OR_TE": True,
                                   "USING_APEX_OPTIMIZER": True, "USING_TE_OPTIMIZER": False}}
    for module, names in choices.items():
        for name, value in names.items():
            if name in vars(module):  # the flags differ between 0.12 and 0.16
                setattr(module, name, value)


# --- 1. device literals ------------------------------------------------------------------------

@contextlib.contextmanager
def cuda_literals_on_cpu():
    """Test shim: inside, factory calls with ``device='cuda'`` allocate on the CPU,
    ``Tensor.cuda()`` returns the tensor and ``Tensor.type()`` reports the CUDA type name.

    Replaces: the optimizer's hard-coded ``device='cuda'`` scalars (``found_inf``,
    ``_dummy_overflow_buf``, ``_scale_one``, gradient-norm buffers) and its parameter type
    check (``model_param.type() == 'torch.cuda.FloatTensor'``) in ``DistributedOptimizer``.
    Cannot change numerics: it only chooses the device of a buffer (the CPU, like every other
    tensor here) and the text of a type name; the dtype is untouched."""
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaLiteralsOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            name = getattr(func, "__name__", "")
            device = kwargs.get("device")
            if device is not None and not isinstance(device, int) and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            if name == "cuda" and args and torch.is_tensor(args[0]):
                return args[0]
            if name == "type" and len(args) == 1 and not kwargs:
                text = func(*args)
                return text if ".cuda." in text else text.replace("torch.", "torch.cuda.", 1)
            return func(*args, **kwargs)

    with CudaLiteralsOnCpu():
        yield


# --- 2-6. checkpointing on this stack --------------------------------------------------------

def _cuda_synchronize() -> bool:
    """Test shim: ``torch.cuda.synchronize`` is a no-op. Replaces: dist_checkpointing's writer
    synchronizing the device before it copies tensors to the host. Cannot change numerics:
    every op is synchronous on CPU."""
    import torch
    if torch.cuda.is_available():
        return False
    torch.cuda.synchronize = lambda device=None: None
    return True


def _fp8_quantize_without_te() -> bool:
    """Test shim (Megatron-Core 0.12.1 without TransformerEngine): ``quantize_param_shard`` with
    no FP8 parameter is a no-op. Replaces: the fallback that raises "Invalid Transformer Engine
    version" on every distributed-optimizer step, even when there is nothing to quantize (with
    TransformerEngine the same call loops over an empty list). Cannot change numerics: no FP8
    parameter exists; a call with FP8 parameters still reaches the original."""
    from megatron.core import fp8_utils
    from megatron.core.optimizer import distrib_optimizer
    impl = inspect.getsource(fp8_utils._quantize_param_shard_impl)
    if "Invalid Transformer Engine" not in impl or "len(model_params)" in impl:
        return False  # TransformerEngine present, or the fallback handles the empty case (0.16)
    original = distrib_optimizer.quantize_param_shard

    def quantize_param_shard(model_params, *args, **kwargs):
        return None if not model_params else original(model_params, *args, **kwargs)
    distrib_optimizer.quantize_param_shard = quantize_param_shard
    return True


def _write_item_format() -> bool:
    """Test shim (Megatron-Core 0.12.1 with torch >= 2.9): Megatron's async file writer calls
    torch's ``_write_item`` without the ``serialization_format`` argument torch now requires;
    the shim passes ``TORCH_SAVE``, what Megatron-Core 0.16 passes. Cannot change numerics: the
    bytes are written by torch's own writer in its default format."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    write_item = filesystem_async._write_item
    if ("serialization_format" not in inspect.signature(write_item).parameters
            or "serialization_format" in inspect.getsource(filesystem_async)):
        return False
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    filesystem_async._write_item = lambda *args, **kwargs: write_item(
        *args, **{"serialization_format": SerializationFormat.TORCH_SAVE, **kwargs})
    return True


def _mcore_metadata_kept() -> bool:
    """Test shim (Megatron-Core 0.12.1 with torch >= 2.9): the checkpoint's ``.metadata`` keeps
    Megatron's ``mcore_data``. Megatron 0.12.1 sets it as an extra attribute of torch's
    ``Metadata``; torch's ``FileSystemWriter.finish`` now rebuilds the object with
    ``dataclasses.replace``, which keeps dataclass fields only, so the global shapes of N-D
    flattened tensors (distributed-optimizer states) are lost and loading them fails. The shim
    returns the planner's metadata as a dataclass subclass with ``mcore_data`` as a field.
    Cannot change numerics: the same metadata, kept."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint.metadata import Metadata
    planner = mcore_torch.MCoreSavePlanner
    if "mcore_data" not in inspect.getsource(planner.create_global_plan):
        return False
    global McoreMetadata

    @dataclasses.dataclass
    class McoreMetadata(Metadata):
        mcore_data: dict = None
    McoreMetadata.__module__, McoreMetadata.__qualname__ = __name__, "McoreMetadata"
    original = planner.create_global_plan

    def create_global_plan(self, all_plans):
        plans, metadata = original(self, all_plans)
        if not isinstance(metadata, McoreMetadata):
            fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
            metadata = McoreMetadata(**fields, mcore_data=getattr(metadata, "mcore_data", None))
        return plans, metadata
    planner.create_global_plan = create_global_plan
    return True


def _numpy_product() -> bool:
    """Test shim (Megatron-Core 0.12.1 with NumPy 2): ``numpy.product``, removed in NumPy 2.0 and
    still called by 0.12.1's flattened-tensor validation, is ``numpy.prod``. Cannot change
    numerics: the alias it was."""
    import numpy
    from megatron.core.dist_checkpointing import validation
    if "product" in vars(numpy) or "np.product" not in inspect.getsource(validation):
        return False
    numpy.product = numpy.prod
    return True


CHECKPOINT_SHIMS = {
    "cuda_synchronize": _cuda_synchronize,
    "fp8_quantize_without_te": _fp8_quantize_without_te,
    "write_item_format": _write_item_format,
    "mcore_metadata_kept": _mcore_metadata_kept,
    "numpy_product": _numpy_product,
}


def install_checkpoint_shims() -> list[str]:
    """Install the shims 2-6 this stack needs (idempotent); returns the names applied."""
    for name, shim in CHECKPOINT_SHIMS.items():
        if name not in _installed and shim():
            _installed.append(name)
    return list(_installed)
