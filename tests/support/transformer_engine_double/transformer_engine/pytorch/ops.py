"""TransformerEngine DOUBLE: ``transformer_engine.pytorch.ops`` -- the fusible operations
Megatron-Bridge 0.3.1's LoRA layers name in annotations evaluated at import, with upstream's
constructor signatures (TE 2.x); constructing any of them raises."""

from __future__ import annotations

import torch

from .. import DoubleNotImplemented


class FusibleOperation(torch.nn.Module):
    """Base of the doubled operations (upstream: ``transformer_engine.pytorch.ops.FusibleOperation``)."""

    def __init__(self, *args, **kwargs):
        raise DoubleNotImplemented(f"pytorch.ops.{type(self).__name__}")


class Sequential(torch.nn.Module):
    def __init__(self, *args: FusibleOperation):
        raise DoubleNotImplemented("pytorch.ops.Sequential")


class Linear(FusibleOperation):
    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, device=None, dtype=None,
                 tensor_parallel_mode=None, tensor_parallel_group=None, sequence_parallel: bool = False,
                 rng_state_tracker_function=None, accumulate_into_main_grad: bool = False):
        super().__init__()


class LayerNorm(FusibleOperation):
    def __init__(self, normalized_shape, *, eps: float = 1e-5, device=None, dtype=None,
                 zero_centered_gamma: bool = False, sm_margin: int = 0):
        super().__init__()


class RMSNorm(FusibleOperation):
    def __init__(self, normalized_shape, *, eps: float = 1e-5, device=None, dtype=None,
                 zero_centered_gamma: bool = False, sm_margin: int = 0):
        super().__init__()


class Quantize(FusibleOperation):
    def __init__(self, forward: bool = True, backward: bool = False):
        super().__init__()


class MakeExtraOutput(FusibleOperation):
    def __init__(self, *, in_place: bool = False):
        super().__init__()


class Dropout(FusibleOperation):
    def __init__(self, p: float):
        super().__init__()


class ConstantScale(FusibleOperation):
    def __init__(self, scale: float):
        super().__init__()


class AddExtraInput(FusibleOperation):
    def __init__(self, *, in_place: bool = False):
        super().__init__()


__all__ = ["FusibleOperation", "Sequential", "Linear", "LayerNorm", "RMSNorm", "Quantize", "MakeExtraOutput",
           "Dropout", "ConstantScale", "AddExtraInput"]
