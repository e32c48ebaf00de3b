"""TransformerEngine DOUBLE: ``transformer_engine.pytorch`` -- ``Linear``, ``LayerNormLinear``,
``fp8_autocast`` and the ``ops`` module, with upstream's signatures (TE 2.x); each raises."""

from __future__ import annotations

import contextlib

import torch

from .. import DoubleNotImplemented
from . import ops


class Linear(torch.nn.Module):
    """Double of ``transformer_engine.pytorch.Linear`` (a linear layer with TP and FP8)."""

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker=None, rng_tracker_name=None, init_method=None, bias: bool = True,
                 return_bias: bool = False, params_dtype=None, parallel_mode=None, parameters_split=None,
                 device="cuda", ub_overlap_rs: bool = False, ub_overlap_ag: bool = False, ub_name=None,
                 delay_wgrad_compute: bool = False, symmetric_ar_type=None, name=None):
        raise DoubleNotImplemented("pytorch.Linear")


class LayerNormLinear(torch.nn.Module):
    """Double of ``transformer_engine.pytorch.LayerNormLinear`` (norm fused into a linear layer)."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker=None, rng_tracker_name=None, init_method=None, bias: bool = True,
                 normalization: str = "LayerNorm", return_bias: bool = False, params_dtype=None,
                 parallel_mode=None, return_layernorm_output: bool = False,
                 return_layernorm_output_gathered: bool = False, parameters_split=None,
                 zero_centered_gamma: bool = False, device="cuda", ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_name=None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type=None, name=None):
        raise DoubleNotImplemented("pytorch.LayerNormLinear")


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None,
                 _graph: bool = False):
    """Double of ``transformer_engine.pytorch.fp8_autocast``."""
    raise DoubleNotImplemented("pytorch.fp8_autocast")
    yield  # pragma: no cover -- a generator, as upstream's context manager


__all__ = ["Linear", "LayerNormLinear", "fp8_autocast", "ops"]
