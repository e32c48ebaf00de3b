"""Scenarios of ``test_megatron_harness.py``, run on every rank of a gloo group by
``tests.support.child.run_group`` (never imported by the pytest process).

``check_layouts`` first computes, on every rank, the unsharded model of each architecture
(tp = ep = 1, SequentialMLP experts, the whole global batch: the 1-process model, run
redundantly, with no communication in its forward or backward); then it runs the same
canonical weights and global batch in each case's parallel layout, one after the other in
the same processes, and compares logits, the global loss and every local gradient with
the reference's shard of them. A case is a dict: ``moe`` (None, "sequential",
"grouped"), ``tp``, ``ep``, ``etp``, ``dtype``.
"""

from __future__ import annotations

import time

from dataclasses import dataclass

BATCH = 4   # global batch: 4 sequences of Arch.seq_len tokens


def ref_key(case: dict) -> tuple:
    """Cases with the same architecture share one reference."""
    return bool(case.get("moe")), case.get("dtype", "float32")


def _reference(case: dict) -> dict:
    """The 1-process model: logits, mean loss and canonical gradients on the global batch."""
    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from tests.support.megatron import canonical_shapes, megatron_model
    with megatron_model(moe="sequential" if case.get("moe") else None, dtype=case.get("dtype", "float32")) as h:
        assert h.tp_size == h.ep_size == 1
        tokens = h.tokens(batch=BATCH, seed=1)
        logits = h.forward(tokens)
        kept = logits.detach().clone()        # Megatron's cross entropy works in place on fp32 logits
        loss = vocab_parallel_cross_entropy(logits, torch.roll(tokens, shifts=-1, dims=1)).mean()
        loss.backward()                       # no finalize_grads: nothing is sharded or split
        grads = h.to_canonical({n: g.detach().clone() for n, g in h.grads().items()})
        assert set(grads) == set(canonical_shapes(h.arch)), "canonical names != the model's parameters"
        return {"loss": loss.item(), "grads": grads, "logits": kept}


def check_layouts(cases: list) -> list:
    """Every rank: each case's layout in turn; its errors against the 1-process model."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from tests.support import megatron_shims
    from tests.support.megatron import megatron_model
    t0 = time.time()
    refs = {}
    for case in cases:
        if ref_key(case) not in refs:
            refs[ref_key(case)] = _reference(case)
    results = [{"reference_seconds": round(time.time() - t0, 2)}]
    for case in cases:
        t0 = time.time()
        ref = refs[ref_key(case)]
        with megatron_model(tp=case.get("tp", 1), ep=case.get("ep", 1), etp=case.get("etp"),
                            moe=case.get("moe"), dtype=case.get("dtype", "float32")) as h:
            tokens = h.tokens(batch=BATCH, seed=1)
            with torch.no_grad():                                         # [b/dp, s, vocab/tp]
                logits = h.forward(h.local_batch(tokens))
            ref_logits = h.local_batch(ref["logits"]).chunk(h.tp_size, dim=-1)[h.tp_rank]
            logits_err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
            loss = h.loss(tokens)
            loss.backward()
            h.finalize_grads()
            total = loss.detach().clone()
            dist.all_reduce(total, group=ps.get_data_parallel_group())    # the global mean
            expected = h.local_view(ref["grads"])
            errors = {name: ((g - expected[name]).abs().max() / expected[name].abs().max()).item()
                      for name, g in h.grads().items()}
            worst = max(errors, key=errors.get)
            mlp = h.model.decoder.layers[0].mlp
            results.append({
                "case": case, "loss": total.item(), "ref_loss": ref["loss"], "logits_rel_err": logits_err,
                "grad_rel_err": errors[worst], "worst": worst,
                "params": len(list(h.model.parameters())), "grads": len(errors),
                "sizes": {"tp": h.tp_size, "ep": h.ep_size, "etp": h.etp_size, "dp": h.dp_size},
                "sequence_parallel": h.config.sequence_parallel,
                "experts": type(mlp.experts).__name__ if case.get("moe") else None,
                "dispatcher": type(mlp.token_dispatcher).__name__ if case.get("moe") else None,
                "dtype": str(next(h.model.parameters()).dtype),
                "shims": megatron_shims.applied(),
                "seconds": round(time.time() - t0, 2)})
    return results


@dataclass
class ScatteredColumns:
    """What one rank of a 2-rank gloo group received when rank 0 scattered the two column
    blocks (``torch.chunk(full, 2, dim=1)``, non-contiguous views) of a 4 x 6 ``arange``."""
    rank: int
    wanted: list        # its column block
    stock: list         # what torch's own gloo scatter delivered
    shimmed: list       # what it delivered through the gloo_strided_scatter test shim
    storage_order: list  # the full tensor's storage read in order from the block's offset


def scatter_column_blocks() -> ScatteredColumns:
    """The gloo_strided_scatter shim's reason (tests/support/megatron_shims.py), on this torch."""
    import torch
    import torch.distributed as dist
    from tests.support import megatron_shims
    stock_scatter = dist.scatter
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    blocks = list(torch.chunk(full, 2, dim=1))
    rank = dist.get_rank()
    received = {}
    for how in ("stock", "shimmed"):
        if how == "shimmed":
            megatron_shims.shim_gloo_strided_scatter()
        out = torch.empty(4, 3)
        dist.scatter(out, blocks if rank == 0 else None, src=0)
        received[how] = out.tolist()
    if dist.scatter is not stock_scatter:
        dist.scatter = stock_scatter
    block = blocks[rank]
    storage = full.reshape(-1)[block.storage_offset():][:block.numel()].reshape(block.shape)
    return ScatteredColumns(rank, block.tolist(), received["stock"], received["shimmed"], storage.tolist())
