"""Child-process scenario of ``test_actor.py``: verl 0.6.1's real ``MegatronPPOActor`` updating a
tiny real Megatron-Core GPT on one gloo rank (run by ``tests.support.child.run_group``).

Real: ``MegatronPPOActor`` (constructed by its ``__init__`` from verl's generated actor config),
its ``forward_backward_batch`` with the loss closure, ``get_policy_loss_fn`` and the vanilla
PPO loss, Megatron-Core's ``forward_backward_no_pipelining`` schedule, ``GPTModel`` and
vocab-parallel log-probs (tests/support/megatron.py builds the model: fp32 on CPU, with the
shims listed in tests/support/megatron_shims.py). Doubles: verl's model forward
(``verl.models.mcore.get_mcore_forward_fn``), which packs sequences into the THD layout that
only TransformerEngine's attention accepts: here the model runs on the padded batch with an
explicit causal mask and verl's own ``logits_processor`` (temperature, log-probs); and
Megatron's ``finalize_model_grads`` is off (the model is not wrapped in Megatron's DDP; one
rank has no gradients to reduce). One test shim beyond tests/support/megatron_shims.py
(:func:`_shim_schedule_token_counter`): Megatron-Core 0.12's no-pipelining schedule allocates
its token counter with ``device="cuda"``; here on the CPU (it only counts tokens).
"""

from __future__ import annotations

import os

BATCH, PROMPT, RESPONSE = 4, 5, 6
TEMPERATURE = 0.8


class _TorchOnCpu:
    """``torch`` as the schedules module sees it, except that ``zeros(..., device="cuda")``
    allocates on the CPU."""

    def __getattr__(self, name):
        import torch
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        import torch
        return torch.zeros(*args, device="cpu" if str(device).startswith("cuda") else device, **kwargs)


def _shim_schedule_token_counter() -> None:
    """Test shim: Megatron-Core's ``forward_backward_no_pipelining`` counts tokens in a tensor
    it creates with ``device="cuda"``; the count lives on the CPU here. Cannot change
    numerics: the counter only feeds ``finalize_model_grads`` (off here) under
    ``calculate_per_token_loss``."""
    from megatron.core.pipeline_parallel import schedules
    schedules.torch = _TorchOnCpu()


def _forward_double(model, input_ids, attention_mask, position_ids, multi_modal_inputs=None,
                    logits_processor=None, logits_processor_args=None, value_model=False):
    import torch
    seq = input_ids.shape[1]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=causal)
    return logits_processor(logits, **logits_processor_args)


def _batch(mark: bool):
    import torch
    from verl.protocol import DataProto

    from ascend_rl_plugins.features.onpolicy_old_logprob import MARK
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (BATCH, PROMPT + RESPONSE), generator=g)
    response_mask = torch.ones(BATCH, RESPONSE, dtype=torch.long)
    response_mask[1, 4:] = 0  # a shorter response
    meta = {"temperature": TEMPERATURE}
    if mark:
        meta[MARK] = True
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": torch.ones(BATCH, PROMPT + RESPONSE, dtype=torch.long),
        "position_ids": torch.arange(PROMPT + RESPONSE).expand(BATCH, -1).clone(),
        "responses": ids[:, PROMPT:].clone(), "response_mask": response_mask,
        "advantages": torch.linspace(-1.5, 2.0, BATCH)[:, None].expand(BATCH, RESPONSE).clone(),
        # what the trainer's skipped pass hands over (NaN placeholders)
        "old_log_probs": torch.full((BATCH, RESPONSE), float("nan")),
    }, meta_info=meta)


def _actor(h):
    from types import SimpleNamespace

    import torch
    import verl
    from omegaconf import OmegaConf
    from verl.workers.actor.megatron_actor import MegatronPPOActor
    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                      "_generated_ppo_megatron_trainer.yaml")).actor_rollout_ref.actor
    cfg.ppo_mini_batch_size = BATCH
    cfg.ppo_micro_batch_size_per_gpu = BATCH
    actor = MegatronPPOActor(config=cfg, model_config=None, hf_config=SimpleNamespace(architectures=["toy"]),
                             tf_config=h.config, actor_module=[h.model], actor_optimizer=None)
    h.config.finalize_model_grads_func = None
    return actor


def _reference_gradients(h, data) -> dict:
    """The on-policy policy gradient, by hand: token-mean of ``-A * log pi(response)`` over the
    response mask, through the same model and forward."""
    import torch
    from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_from_logits
    h.model.zero_grad(set_to_none=True)
    b = data.batch
    seq = b["input_ids"].shape[1]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    logits = h.model(input_ids=b["input_ids"], position_ids=b["position_ids"], attention_mask=causal) / TEMPERATURE
    labels = torch.roll(b["input_ids"], shifts=-1, dims=1)
    log_probs = vocab_parallel_log_probs_from_logits(logits, labels)[:, PROMPT - 1:-1]
    mask = b["response_mask"].float()
    loss = (-b["advantages"] * log_probs * mask).sum() / mask.sum()
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in h.model.named_parameters()}


def _update(h, actor, marked: bool) -> dict:
    """One ``forward_backward_batch`` update; its metrics and gradients vs. the reference."""
    import torch
    data = _batch(marked)
    h.model.zero_grad(set_to_none=True)
    out = actor.forward_backward_batch(data, forward_only=False, micro_batch_size=BATCH,
                                       calculate_entropy=False, use_dynamic_bsz=False, mini_batch_size=BATCH)
    metrics = out["output"][0][0]
    grads = {n: p.grad.detach().clone() for n, p in h.model.named_parameters() if p.grad is not None}
    reference = _reference_gradients(h, _batch(marked))
    assert set(grads) == set(reference)
    worst = max(((grads[n] - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for n, r in reference.items())
    return {"metrics": {k: [float(x) for x in (v if isinstance(v, list) else [v])] for k, v in metrics.items()},
            "relative_error": worst, "params": len(reference)}


def updates() -> dict:
    """The same update three ways, on one model: patched on a marked batch (what the trainer
    sends when it skipped the pass), patched on an unmarked batch, and unpatched."""
    import verl.models.mcore as mcore

    from ascend_rl_plugins.features import onpolicy_old_logprob
    from ascend_rl_plugins.patching.core import REGISTRY
    from tests.support.megatron import megatron_model
    patches = [REGISTRY.patches[name] for name in ("onpolicy_old_logprob.megatron_update",
                                                  "onpolicy_old_logprob.megatron_policy_loss")]
    mcore.get_mcore_forward_fn = lambda hf_config: _forward_double
    _shim_schedule_token_counter()
    out = {}
    with megatron_model(layers=1) as h:
        actor = _actor(h)
        for p in patches:
            assert REGISTRY.apply(p), p.outcome
        out["patched_marked"] = _update(h, actor, marked=True)
        out["patched_unmarked"] = _update(h, actor, marked=False)
        for p in patches:
            REGISTRY.revert(p)
        out["unpatched_marked"] = _update(h, actor, marked=True)
    out["context_clear"] = onpolicy_old_logprob.ON_POLICY_UPDATE.get() is False
    return out
