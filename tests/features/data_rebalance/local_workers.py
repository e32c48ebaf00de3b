"""A verl worker group whose workers run in this process (test double of Ray's execution).

Real: verl's ``WorkerGroup`` base class (the dispatch functions assert it), its
``_bind_worker_method`` (which reads each registered method's dispatch mode off the worker
class and builds the driver-side callable through ``func_generator``), the dispatch and
collect functions, ``DataProto``. Doubles: ``ray.put`` (inside verl's ``parallel_put``) and
``ray.get`` (inside ``func_generator``'s callable) are identities, and ``execute_all`` runs a
per-rank function here instead of a remote call. ``generate`` plays a rollout: a response
that depends only on the prompt row and the sample's ``sample_id``, never on which rank made
it or where in the batch it sat, so any reordering bug shows in the outputs.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

RAY_DOUBLE = SimpleNamespace(put=lambda obj: obj, get=lambda obj: obj)
RESPONSE_LEN = 12
VOCAB = 1000


def install_ray_doubles(monkeypatch) -> None:
    """``ray.put`` / ``ray.get`` as identities in the two verl modules that call them here."""
    import verl.single_controller.ray.base as ray_base
    import verl.utils.ray_utils as ray_utils
    monkeypatch.setattr(ray_utils, "ray", RAY_DOUBLE)
    monkeypatch.setattr(ray_base, "ray", RAY_DOUBLE)


def response_length(sample_id: int, prompt_sum: int) -> int:
    """A long-tailed, deterministic length: a few samples much longer than the rest."""
    return 1 + (prompt_sum * 7 + sample_id * 3) % 5 + (6 if prompt_sum % 4 == 0 else 0)


def generate(prompts):
    """A rollout of one chunk: ``responses`` and the concatenated sequences, as verl's vLLM
    rollout returns them (``n = 1``: one response per row)."""
    import torch
    from verl.protocol import DataProto
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    responses = torch.zeros(len(ids), RESPONSE_LEN, dtype=ids.dtype)
    response_mask = torch.zeros(len(ids), RESPONSE_LEN, dtype=mask.dtype)
    for row, sample_id in enumerate(prompts.non_tensor_batch["sample_id"].tolist()):
        total = int(ids[row][mask[row].bool()].sum())
        length = response_length(sample_id, total)
        responses[row, :length] = (torch.arange(length) * 31 + total + 17 * sample_id) % VOCAB
        response_mask[row, :length] = 1
    attention = torch.cat([mask, response_mask], dim=1)
    return DataProto.from_dict(
        tensors={"prompts": ids, "responses": responses, "input_ids": torch.cat([ids, responses], dim=1),
                 "attention_mask": attention, "position_ids": torch.cumsum(attention, dim=1) - 1},
        non_tensors=dict(prompts.non_tensor_batch),
        meta_info={"timing": {"generate_sequences": 1.0}})


def worker_group_class():
    from verl.single_controller.base.worker_group import WorkerGroup

    class LocalWorkerGroup(WorkerGroup):
        """``tp * dp`` workers; the rollout mesh maps global rank ``g`` to DP rank ``g // tp``
        and collects from TP rank 0, like a megatron rollout with tensor parallelism."""

        def __init__(self, tp: int, dp: int):
            super().__init__(resource_pool=None)
            self._workers = list(range(tp * dp))
            self.tp, self.dp = tp, dp
            self.received: list[list[int]] = []  # per call: sample ids by DP rank, in order
            self.queries = 0

        def execute_all(self, method_name, *args, **kwargs):
            """What every worker returns. The mesh queries are worker methods too (registered
            on verl's ``Worker``); each worker answers with its DP rank / whether it is the
            one its DP rank's output is collected from."""
            if method_name == "_query_dispatch_info":
                self.queries += 1
                return [g // self.tp for g in range(self.world_size)]
            if method_name == "_query_collect_info":
                return [g % self.tp == 0 for g in range(self.world_size)]
            assert method_name.endswith("generate_sequences"), method_name
            chunks = args[0]
            by_dp = [[] for _ in range(self.dp)]
            for g, chunk in enumerate(chunks):
                ids = chunk.non_tensor_batch["sample_id"].tolist()
                if g % self.tp == 0:
                    by_dp[g // self.tp] = ids
                else:  # a TP peer gets its DP rank's very chunk
                    assert ids == [int(x) for x in chunks[g - g % self.tp].non_tensor_batch["sample_id"]]
            self.received.append(by_dp)
            return [generate(chunk) for chunk in chunks]

        execute_rank_zero = execute_all

    return LocalWorkerGroup


def interleaved_batch(prompts: int, n: int, prompt_len: int = 6, seed: int = 0):
    """A GRPO generation batch as RayPPOTrainer builds it: ``prompts`` left-padded prompts,
    ``repeat(n, interleave=True)``; ``sample_id`` numbers the rows in the caller's order."""
    import torch
    from verl.protocol import DataProto
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (prompts, prompt_len), generator=g)
    lengths = torch.randint(2, prompt_len + 1, (prompts,), generator=g)
    mask = (torch.arange(prompt_len)[None, :] >= prompt_len - lengths[:, None]).long()
    ids = ids * mask  # left padding with token 0
    raw = np.empty(prompts, dtype=object)
    raw[:] = [r[m.bool()].tolist() for r, m in zip(ids, mask)]
    batch = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": torch.clamp(mask.cumsum(1) - 1, min=0)},
        non_tensors={"raw_prompt_ids": raw}, meta_info={"global_steps": 1})
    batch = batch.repeat(repeat_times=n, interleave=True)
    batch.non_tensor_batch["sample_id"] = np.arange(prompts * n, dtype=np.int64)
    return batch
