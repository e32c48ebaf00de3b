"""A real verl 0.6.1 ``RayPPOTrainer`` that runs on CPU without Ray (test support).

Real: verl's generated Megatron trainer config (``_generated_ppo_megatron_trainer.yaml``,
with the overrides below), ``RayPPOTrainer.__init__`` (dataloaders from a 4-prompt in-memory
dataset with verl's own collate function and sampler), ``RayPPOTrainer.fit`` (one GRPO step:
repeat, generation call, reward, old-log-prob call, advantages, actor update, metrics,
console logging), ``validate_config``. Doubles: the actor's Ray worker group
(:class:`WorkerGroupDouble`: a rollout that answers with fixed responses, an old-log-prob
pass and an actor update that only record their calls) and the reward function.
"""

from __future__ import annotations

import os

PROMPTS, N, PROMPT_LEN, RESPONSE_LEN = 4, 2, 6, 5
TEMPERATURE = 0.7


def config(**overrides):
    """The trainer config: on-policy GRPO (one epoch, one mini-batch) unless ``overrides``
    (dotted keys) say otherwise."""
    import verl
    from omegaconf import OmegaConf, open_dict
    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                      "_generated_ppo_megatron_trainer.yaml"))
    settings = {
        "data.train_batch_size": PROMPTS, "data.val_batch_size": None, "data.dataloader_num_workers": 0,
        "actor_rollout_ref.rollout.n": N, "actor_rollout_ref.rollout.temperature": TEMPERATURE,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 1,
        "actor_rollout_ref.actor.ppo_mini_batch_size": PROMPTS, "actor_rollout_ref.actor.ppo_epochs": 1,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1, "actor_rollout_ref.actor.use_kl_loss": False,
        "algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": False, "critic.enable": False,
        "trainer.logger": ["console"], "trainer.total_training_steps": 1, "trainer.val_before_train": False,
        "trainer.test_freq": -1, "trainer.save_freq": -1, "trainer.balance_batch": False,
        "trainer.n_gpus_per_node": 1, "trainer.nnodes": 1, "trainer.resume_mode": "disable",
        "trainer.device": "cpu",
    }
    settings.update(overrides)
    with open_dict(cfg):
        for key, value in settings.items():
            OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def dataset():
    import torch

    class Prompts(torch.utils.data.Dataset):
        def __len__(self):
            return PROMPTS

        def __getitem__(self, i):
            ids = torch.randint(3, 100, (PROMPT_LEN,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "attention_mask": torch.ones(PROMPT_LEN, dtype=torch.long),
                    "position_ids": torch.arange(PROMPT_LEN), "raw_prompt_ids": ids.tolist(),
                    "data_source": "toy", "reward_model": {"ground_truth": str(i)}}
    return Prompts()


class WorkerGroupDouble:
    """The actor/rollout worker group, in process: counts each call, keeps the update's batch.
    ``workers_patched``: its update reports what Megatron workers running ascend-rl's actor
    patch report for a marked batch (the acknowledgement metric), or not."""

    world_size = 1

    def __init__(self, workers_patched: bool = True):
        self.calls = {"generate_sequences": 0, "compute_log_prob": 0, "update_actor": 0}
        self.updated_with = None
        self.workers_patched = workers_patched

    def generate_sequences(self, batch):
        import torch
        from verl.protocol import DataProto
        self.calls["generate_sequences"] += 1
        ids = batch.batch["input_ids"]
        responses = (ids[:, :RESPONSE_LEN] * 7) % 50
        attention = torch.cat([batch.batch["attention_mask"], torch.ones(len(ids), RESPONSE_LEN, dtype=torch.long)], 1)
        return DataProto.from_dict(
            tensors={"prompts": ids, "responses": responses, "input_ids": torch.cat([ids, responses], 1),
                     "attention_mask": attention, "position_ids": torch.cumsum(attention, 1) - 1},
            meta_info={"timing": {"generate_sequences": 0.1}})

    def compute_log_prob(self, batch):
        """What the real method returns (old log-probs, entropies, temperature), computed by
        a forward pass of the actor in the real one."""
        import torch
        from verl.protocol import DataProto
        self.calls["compute_log_prob"] += 1
        shape = tuple(batch.batch["responses"].shape)
        return DataProto.from_dict(tensors={"old_log_probs": -torch.ones(shape), "entropys": torch.ones(shape)},
                                   meta_info={"temperature": TEMPERATURE})

    def load_checkpoint(self, *args, **kwargs):
        pass

    def update_actor(self, batch):
        from verl.protocol import DataProto

        from ascend_rl_plugins.features.onpolicy_old_logprob import ACK, MARK
        self.calls["update_actor"] += 1
        self.updated_with = batch
        metrics = {"actor/pg_loss": [0.0]}
        if self.workers_patched and batch.meta_info.get(MARK):
            metrics[ACK] = [1.0]
        return DataProto(meta_info={"metrics": metrics})


def reward_fn(data, return_dict=False):
    import torch
    scores = torch.zeros(len(data), RESPONSE_LEN)
    scores[:, -1] = (data.batch["responses"][:, 0] % 3).float()
    return {"reward_tensor": scores, "reward_extra_info": {}} if return_dict else scores


def trainer(cfg, workers_patched: bool = True):
    """``RayPPOTrainer(cfg)`` built by its real ``__init__``, with the worker-group double
    where ``init_workers`` would have put the Ray worker group."""
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.utils import Role
    pools = ray_trainer.ResourcePoolManager(resource_pool_spec={"global_pool": [1]},
                                            mapping={Role.ActorRollout: "global_pool"})
    t = ray_trainer.RayPPOTrainer(config=cfg, tokenizer=None, role_worker_mapping={Role.ActorRollout: object},
                                  resource_pool_manager=pools, reward_fn=reward_fn, val_reward_fn=None,
                                  train_dataset=dataset(), val_dataset=dataset())
    t.actor_rollout_wg = WorkerGroupDouble(workers_patched)
    t.async_rollout_mode = False
    return t
