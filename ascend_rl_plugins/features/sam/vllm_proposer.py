"""SAM proposer for vLLM's GPU/CPU model runner (vLLM 0.13 and 0.23).

``speculative_config={"method": "sam", ...}`` is rewritten to ``method="ngram",
model="sam"`` before vLLM validates it, so every ngram code path, assert and scheduler
rule of vLLM applies unchanged; the runner builds its drafter by calling ``NgramProposer``,
which this feature wraps to return :class:`SamNgramProposer` (a subclass of the pristine
``NgramProposer``, so the runner's ``isinstance`` asserts hold) when ``model == "sam"``.

The runner hands the proposer the ids of the rows only on 0.13; on 0.23 the ngram call has
no request ids, so a before-hook on ``GPUModelRunner.propose_draft_token_ids`` gives the
proposer the runner (its ``input_batch``: ids, prompt lengths, unsupported requests; its
``requests``: each request's sampling parameters, read once per request for the history's
stop conditions, in both versions).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .automaton import compile_step_kernel
from .drafter import SamDrafter, StopConditions

log = logging.getLogger("ascend_rl_plugins")

SAM_MODEL_NAME = "sam"
_SUBCLASSES: dict[type, type] = {}


def is_sam_config(vllm_config) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and getattr(spec, "model", None) == SAM_MODEL_NAME


def drafter_settings(vllm_config) -> dict:
    """``SamDrafter`` keyword arguments from the engine config and the feature's flags."""
    from . import (ADAPTIVE, BATCH_THRESHOLD, COMPUTE_BOUND_BATCH, CROSS_PROMPT_TOKENS, GROUP,
                   HISTORY_PER_PROMPT, HISTORY_TOKENS, MIN_MATCH, RECENT_LEN, TOKEN_COST)
    spec = vllm_config.speculative_config
    return dict(k=int(spec.num_speculative_tokens), min_match=MIN_MATCH.value,
                group=GROUP.value, batch_threshold=BATCH_THRESHOLD.value,
                recent_len=RECENT_LEN.value, adaptive=ADAPTIVE.value,
                max_model_len=int(vllm_config.model_config.max_model_len),
                history_tokens=HISTORY_TOKENS.value, history_per_prompt=HISTORY_PER_PROMPT.value,
                token_cost=TOKEN_COST.value, compute_bound_batch=COMPUTE_BOUND_BATCH.value,
                cross_prompt_tokens=CROSS_PROMPT_TOKENS.value)


def build_drafter(vllm_config, **overrides) -> SamDrafter:
    """The drafter the engine's proposer uses (``overrides``: arguments replacing the flags')."""
    settings = drafter_settings(vllm_config)
    settings.update(overrides)
    return SamDrafter(settings.pop("k"), **settings)


def stop_conditions_of_params(params) -> StopConditions:
    """The conditions on which vLLM's scheduler finishes a request by itself, from its
    ``SamplingParams`` as the runner holds them (0.13 and 0.23). The scheduler stops at the
    model's EOS unless ``ignore_eos``, and at ``stop_token_ids`` (the input processor has added
    the generation config's other EOS ids to them unless ``ignore_eos``); ``all_stop_token_ids``
    is those plus the EOS ids whatever ``ignore_eos`` says (it serves ``min_tokens``), so it is
    the stop set exactly when EOS counts. ``max_tokens`` is always set by then (the input
    processor fills it from ``max_model_len``)."""
    stop = (params.stop_token_ids or ()) if params.ignore_eos else params.all_stop_token_ids
    return StopConditions(frozenset(int(t) for t in stop), int(params.min_tokens or 0),
                          None if params.max_tokens is None else int(params.max_tokens))


class _SamProposerMixin:
    """Everything but the base class: propose with either runner calling convention."""

    drafter: SamDrafter
    input_batch = None  # set by the propose_draft_token_ids hook (0.23) or from req_ids (0.13)
    runner = None  # the model runner, set by the same hook (vLLM) or at construction (Ascend)
    _rows_cache: list = []

    def _init_sam(self, vllm_config) -> None:
        spec = vllm_config.speculative_config
        self.vllm_config = vllm_config
        self.k = int(spec.num_speculative_tokens)
        self.min_n = getattr(spec, "prompt_lookup_min", None) or 1
        self.max_n = getattr(spec, "prompt_lookup_max", None) or 1
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.sam = build_drafter(vllm_config, stop_conditions_of=self._stop_conditions)
        started = time.perf_counter()
        compile_step_kernel()
        log.info("ascend-rl: SAM drafter k=%d min_match=%d group=%s batch_threshold=%d "
                 "token_cost=%g compute_bound_batch=%d history_tokens=%d "
                 "cross_prompt_tokens=%d (kernel ready in %.2f s)", self.k,
                 self.sam.pool.min_match, self.sam.group, self.sam.batch_threshold,
                 self.sam.token_cost, self.sam.compute_bound_batch,
                 self.sam.history.max_tokens if self.sam.history else 0,
                 self.sam.cross_prompt_tokens, time.perf_counter() - started)

    def bind_runner(self, runner) -> None:
        self.runner = runner
        self.input_batch = runner.input_batch

    def _stop_conditions(self, req_id: str) -> StopConditions | None:
        """A request's stop conditions, asked by the drafter when the request first shows up
        (the runner still holds its state then; it drops a finished request's state before
        the step whose batch no longer has it). None where the runner has no sampling
        parameters for it: its response is then never kept."""
        requests = getattr(self.runner, "requests", None)
        state = requests.get(req_id) if requests is not None else None
        params = getattr(state, "sampling_params", None)
        return None if params is None else stop_conditions_of_params(params)

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        """0.13: (sampled, req_ids, num_tokens_no_spec, token_ids_cpu, unsupported);
        0.23: (sampled, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)."""
        if args and isinstance(args[0], (list, tuple)):
            req_ids, num_tokens, token_ids, unsupported = args[0], args[1], args[2], \
                (args[3] if len(args) > 3 else kwargs.get("spec_decode_unsupported_reqs", ()))
        else:
            batch = self.input_batch
            if batch is None:
                raise RuntimeError("SAM proposer was called without request ids; the "
                                   "propose_draft_token_ids hook of ascend-rl is not active")
            num_tokens, token_ids = args[0], args[1]
            req_ids = batch.req_ids
            unsupported = getattr(batch, "spec_decode_unsupported_reqs", ())
        return self.propose_for(sampled_token_ids, req_ids, num_tokens, token_ids, unsupported)

    def propose_for(self, sampled_token_ids, req_ids, num_tokens, token_ids,
                    unsupported=()) -> list[list[int]]:
        """Drafts for the rows of ``sampled_token_ids`` ([] for rows that get none).

        A row is drafted for when it sampled a token this step (not a partial prefill) and
        its request supports speculation; requests at ``max_model_len`` get an empty draft
        from the drafter's cap. In the common step (every row sampled, no unsupported
        request) there is no Python loop over the rows here."""
        n = len(sampled_token_ids)
        drafts: list[list[int]] = [[] for _ in range(n)]
        if not n:
            return drafts
        ids = req_ids if len(req_ids) == n else (list(req_ids[:n]) + [None] * (n - len(req_ids)))
        self.sam.retain_only(req_ids)
        if type(sampled_token_ids) is list and all(sampled_token_ids) and not unsupported \
                and None not in ids:
            rows = self._all_rows(n)
        else:
            rows = [i for i in range(n) if ids[i] is not None and len(sampled_token_ids[i])
                    and ids[i] not in unsupported]
            if not rows:
                return drafts
            ids = [ids[i] for i in rows]
        prompt_lens = getattr(self.input_batch, "num_prompt_tokens", None)  # indexed by row
        got, counts = self.sam.propose_arrays(ids, rows, token_ids, num_tokens,
                                              prompt_lens=prompt_lens, batch_size=len(rows))
        cl = counts.tolist()
        if any(cl):
            for i, (c, d) in enumerate(zip(cl, got.tolist())):
                if c:
                    drafts[rows[i]] = d[:c]
        return drafts

    def _all_rows(self, n: int) -> list[int]:
        rows = self._rows_cache
        if len(rows) != n:
            rows = self._rows_cache = list(range(n))
        return rows

    def load_model(self, *args, **kwargs) -> None:  # nothing to load
        pass


def sam_proposer_class(ngram_base: type) -> type:
    """A subclass of the given (pristine) NgramProposer class that drafts with SAM."""
    cls = _SUBCLASSES.get(ngram_base)
    if cls is None:
        def __init__(self, vllm_config, *args, **kwargs):
            # NgramProposer.__init__ is not called: it only sizes n-gram buffers and
            # JIT-warms the n-gram kernel, neither of which SAM uses.
            self._init_sam(vllm_config)

        cls = type("SamNgramProposer", (_SamProposerMixin, ngram_base), {
            "__init__": __init__, "__module__": __name__,
            "__doc__": "SAM drafter presented as vLLM's NgramProposer (method='ngram', model='sam')."})
        _SUBCLASSES[ngram_base] = cls
    return cls


def make_sam_proposer(ngram_base: type, vllm_config):
    return sam_proposer_class(ngram_base)(vllm_config)


def rewrite_speculative_dict(spec: dict | None) -> dict | None:
    """{"method": "sam", ...} -> {"method": "ngram", "model": "sam", ...}; others unchanged."""
    if not isinstance(spec, dict) or spec.get("method") != SAM_MODEL_NAME:
        return spec
    model = spec.get("model")
    if model not in (None, SAM_MODEL_NAME):
        raise ValueError(f"speculative_config: method='sam' takes no draft model, got "
                         f"model={model!r} (accepted: omit it, or 'sam')")
    out = dict(spec)
    out["method"] = "ngram"
    out["model"] = SAM_MODEL_NAME
    return out
