"""verl 0.9's real ``MegatronEngine`` on CPU ranks (test support, not part of the product).

:func:`megatron_engine` constructs ``MegatronEngineWithLMHead`` with verl's own config classes
and runs its own ``initialize()``: Megatron-Bridge's ``AutoBridge.from_hf_pretrained`` of an HF
checkpoint, the bridge's model provider (``to_megatron_provider``, verl's overrides applied by
verl), ``make_megatron_module`` and ``bridge.load_hf_weights`` -- the model holds exactly the
checkpoint's weights. Call it inside ``tests.support.megatron.parallel_groups`` (verl's
``_init_device_mesh`` then keeps Megatron-Core's ``parallel_state`` as the harness set it up,
which is verl's own branch for an already initialized state).

What is not verl's default, and why (nothing here changes a weight):

- ``forward_only=True``: no DDP wrapper, optimizer or checkpoint manager (they need CUDA
  buffers); the export methods do not use them.
- ``override_transformer_config`` (verl's own key, applied by verl to the bridge's provider):
  ``transformer_layer_spec`` = Megatron-Bridge's ``local_layer_spec`` (Megatron-Core local
  layers: TransformerEngine cannot be installed here), with the harness's sequence-parallel
  norm shim where TP > 1 (tests/support/megatron_shims.py); ``moe_grouped_gemm`` picks
  ``SequentialMLP`` or the legacy ``GroupedMLP``; ``use_cpu_initialization`` and every fusion off.
- Three process-level test shims: Megatron-Bridge imported with the TransformerEngine double
  (tests/support/megatron_bridge.py), verl's device platform answered for the host
  (tests/support/verl_cpu_platform.py), and ``Module.cuda`` a no-op while the model is built
  (``megatron_bridge.module_cuda_stays_on_cpu``: Megatron-Bridge's ``get_model`` moves chunks
  to CUDA because verl does not pass ``use_cpu_initialization``).
- For ``moe="grouped"`` (legacy ``GroupedMLP``) a fourth, around ``initialize()`` only:
  ``megatron_bridge.bridge_load_skips_unmapped_params`` -- Megatron-Bridge 0.3.1 has no mapping
  for ``weight1`` / ``weight2`` and its load fails on their ``None`` tasks (upstream failure
  (b) of the moe_reshard README); with the shim it loads everything else and leaves those two
  uninitialized (``perform_initialization`` is off): the caller puts the experts in. The
  ``grouped_gemm`` package ``GroupedMLP`` asserts at construction is the harness's shim 4.
- The harness's CPU shims (tests/support/megatron_shims.py, installed by ``parallel_groups``);
  at TP or ETP > 1 the bridge's load of row-parallel weights needs shim 8
  (``gloo_strided_scatter``: torch's gloo scatter ignores the strides of the column blocks
  the bridge scatters, which on a GPU arrive as contiguous device copies).
"""

from __future__ import annotations

import contextlib

FUSIONS_OFF = dict(gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                   apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                   moe_permute_fusion=False, moe_router_fusion=False, cross_entropy_loss_fusion=False)


def cpu_layer_spec(config):
    """Megatron-Bridge's ``local_layer_spec`` for the provider's config, with the harness's
    sequence-parallel norms where the config enables sequence parallelism."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    from tests.support.megatron import _with_sequence_parallel_norms
    spec = local_layer_spec(config)
    return _with_sequence_parallel_norms(spec, config.num_layers) if config.sequence_parallel else spec


def megatron_engine(hf_path: str, tp: int, ep: int, etp: int, moe: str = "sequential"):
    """An initialized ``MegatronEngineWithLMHead`` for the HF checkpoint ``hf_path`` (bf16), on
    the ranks of the current ``parallel_state`` (module docstring); ``moe``: ``sequential`` or
    ``grouped`` (then the experts are not loaded: module docstring)."""
    import verl.workers.engine.megatron.transformer_impl as impl  # noqa: F401 -- Megatron-Core before the TE double

    from tests.support import verl_cpu_platform
    from tests.support.megatron import EXPERT_IMPLS
    from tests.support.megatron_bridge import bridge_load_skips_unmapped_params, import_megatron_bridge, \
        module_cuda_stays_on_cpu
    import_megatron_bridge()
    verl_cpu_platform.install()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config.engine import McoreEngineConfig
    from verl.workers.config.model import HFModelConfig
    from verl.workers.config.optimizer import McoreOptimizerConfig

    engine_config = McoreEngineConfig(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1, use_distributed_optimizer=False, forward_only=True, dtype="bfloat16",
        override_transformer_config=dict(transformer_layer_spec=cpu_layer_spec, moe_grouped_gemm=EXPERT_IMPLS[moe],
                                         use_cpu_initialization=True, perform_initialization=False, **FUSIONS_OFF))
    engine = impl.MegatronEngineWithLMHead(HFModelConfig(path=hf_path), engine_config,
                                           McoreOptimizerConfig(lr=1e-6), CheckpointConfig())
    grouped = EXPERT_IMPLS[moe]
    with module_cuda_stays_on_cpu(), bridge_load_skips_unmapped_params() if grouped else contextlib.nullcontext():
        engine.initialize()
    return engine
