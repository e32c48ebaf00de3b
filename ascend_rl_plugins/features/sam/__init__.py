"""SAM speculative decoding: a suffix-automaton drafter for the long tail of RL rollouts.

Replaces the Qwen3 RL recipe's patches 0002-vllm-feature-enable_sam_decoding (vLLM),
0001-vllm_ascend-feature-bs_threshold_for_spec_decode and
0002-vllm_ascend-feature-enable_sam_decoding with ``sam_proposer.py`` (vLLM-Ascend).
Why these patches exist (README.md beside this file: design, flags, figures, verified where):
* vLLM has no ``method="sam"``. ``{"method": "sam"}`` is rewritten to ``method="ngram",
  model="sam"`` before vLLM validates it (so vLLM's own validation and every ngram code
  path stay intact), and the ``NgramProposer`` the model runner instantiates is wrapped to
  return the SAM proposer when ``model == "sam"``. (The recipe rewrote "sam" into "ngram"
  too, which made its vLLM-Ascend SAM branch unreachable; here SAM is selected from
  ``model == "sam"``, which survives the rewrite.)
* vLLM-Ascend builds its drafter in ``NPUModelRunner._get_drafter``; that is wrapped to
  return a SAM proposer derived from the Ascend n-gram proposer of the installed version.
* Batch-size switch: speculation only while the batch is small (long tail of a rollout).
* vLLM-Ascend 0.23's recovered-token sampling for model-free drafts under reduce sampling
  loops per draft token with a host sync each; it is vectorized.
* Speculative decoding on a CPU host (this project's tests, CPU users) is a separate
  feature, ``cpu_spec_decode``: nothing of it matters on an NPU.

Remove when: vLLM (and vLLM-Ascend) ship a suffix-automaton proposer with group sharing
(upstream has ``suffix`` decoding, per request, no recency drafting), or select a proposer
class by name on every supported version (vLLM 0.23 has ``method="custom_class"``;
vLLM-Ascend does not yet) -- then only the drafter remains, as a library.

This module only declares flags and patches; numpy/numba/torch/vLLM are imported by the
submodules, lazily, when a patched function first runs.
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_SAM", "bool", True,
    "Accept speculative_config method='sam' (suffix-automaton drafter) in vLLM and "
    "vLLM-Ascend. Acts only when a request asks for method 'sam'.", feature="sam")
GROUP = flags.define(
    "ASCEND_RL_SAM_GROUP", "bool", True,
    "Group-aware drafting: requests with identical prompt token ids (n>1 children, GRPO "
    "rollouts) share one automaton and draft from each other's generated text (with the "
    "draft-length rule on, a request whose group has other live members also keeps an "
    "automaton of its own text, a source of its own).", feature="sam")
MIN_MATCH = flags.define(
    "ASCEND_RL_SAM_MIN_MATCH", "int", 1,
    "Minimum length of the matched suffix before SAM proposes a draft (confidence gate).",
    minimum=1, maximum=1024, feature="sam")
ADAPTIVE = flags.define(
    "ASCEND_RL_SAM_ADAPTIVE", "bool", False,
    "Confidence cap: a matched suffix of length L proposes at most L tokens (a larger share "
    "of draft tokens accepted, fewer accepted per step). Off by default: SAM "
    "speculates in the long tail of a rollout, where verifying a few more draft tokens costs "
    "almost nothing and accepted tokens per step is what shortens it.",
    feature="sam")
BATCH_THRESHOLD = flags.define(
    "ASCEND_RL_SAM_BATCH_THRESHOLD", "int", 0,
    "Speculate only while at most this many requests are scheduled (0: no fixed threshold). "
    "Above it the automaton keeps ingesting tokens but no draft is proposed or scheduled. "
    "By default the draft-length rule (ASCEND_RL_SAM_TOKEN_COST, "
    "ASCEND_RL_SAM_COMPUTE_BOUND_BATCH) decides per token from the batch size; a value here "
    "overrides it (the recipe's VLLM_SPECULATIVE_BATCH_SIZE_THRE was 32).",
    aliases=("VLLM_SPECULATIVE_BATCH_SIZE_THRE",), minimum=0, feature="sam")
RECENT_LEN = flags.define(
    "ASCEND_RL_SAM_RECENT_LEN", "int", 32,
    "Drafts continue the most recent earlier occurrence of the last min(L, N) tokens, L being "
    "the longest earlier-occurring suffix; also bounds the per-token bookkeeping to N + 1 "
    "states (the recipe's drafter walked every suffix link).",
    minimum=1, maximum=4096, feature="sam")
HISTORY_TOKENS = flags.define(
    "ASCEND_RL_SAM_HISTORY_TOKENS", "int", 1 << 24,
    "History: finished responses are kept by prompt, up to this many tokens in all (4 bytes "
    "each plus small per-response overhead; least recently used prompt evicted first), and "
    "seed the automaton of the same prompt's later requests (next epoch's rollouts, a "
    "sibling that starts after the others finished). 0: off. Default 16,777,216 tokens "
    "(about 64 MiB).",
    minimum=0, feature="sam")
HISTORY_PER_PROMPT = flags.define(
    "ASCEND_RL_SAM_HISTORY_PER_PROMPT", "int", 8,
    "History: at most this many finished responses kept per prompt (its oldest goes first); "
    "they are re-ingested when the prompt's next automaton is built (about 0.15 us per token "
    "on the reference machine, inside that step).",
    minimum=1, maximum=4096, feature="sam")
TOKEN_COST = flags.define(
    "ASCEND_RL_SAM_TOKEN_COST", "float", 0.07,
    "Draft only what will be accepted: the cost of verifying one draft token in a "
    "memory-bound decode step, in accepted tokens. A draft token is proposed only while the "
    "estimated probability that it and every token before it are accepted (learned online "
    "per source, matched length, previous outcome and draft position) is at least the step's "
    "cost, which rises linearly from this value to 1 at ASCEND_RL_SAM_COMPUTE_BOUND_BATCH; "
    "and each step drafts from the source (the request's group, its own text, the "
    "cross-prompt automaton) whose candidate that estimate values most, in expected accepted "
    "tokens less verification. 0: every candidate up to k is drafted, from the group's "
    "automaton, else the cross-prompt one. ASCEND_RL_SAM_MIN_MATCH, ASCEND_RL_SAM_ADAPTIVE "
    "and ASCEND_RL_SAM_BATCH_THRESHOLD still apply first, as overrides.",
    minimum=0.0, maximum=1.0, feature="sam")
COMPUTE_BOUND_BATCH = flags.define(
    "ASCEND_RL_SAM_COMPUTE_BOUND_BATCH", "int", 64,
    "Batch size (running requests) at which verifying a draft token costs as much as "
    "generating it (the decode step is compute-bound): the draft-length rule's cost reaches "
    "1 there and nothing is drafted from it on. Used only with ASCEND_RL_SAM_TOKEN_COST > 0.",
    minimum=1, feature="sam")
CROSS_PROMPT_TOKENS = flags.define(
    "ASCEND_RL_SAM_CROSS_PROMPT_TOKENS", "int", 1 << 20,
    "Cross-prompt automaton: every request's response (live, and finished until it is "
    "replaced; prompts stay in their own automata) also goes into one automaton shared by all "
    "prompts, like the global tree of vLLM's suffix method. It drafts for a request when its candidate is worth more than the request's "
    "group's by the draft-length rule's acceptance estimate (ASCEND_RL_SAM_TOKEN_COST > 0), "
    "and whenever the group has no candidate (a token its group never saw, or saw only at a "
    "level sibling's end). When it "
    "holds this many tokens, or reaches its automaton's id limit (about 3 million tokens), it "
    "is replaced by a fresh one (55-60 bytes per token measured; default 1,048,576 tokens, "
    "about 60 MiB). 0: off.",
    minimum=0, feature="sam")
FEATURE = Feature("sam", "suffix-automaton speculative decoding, group-aware",
                  flag=ENABLE,
                  replaces="the Qwen3 RL recipe's patches 0002-vllm-feature-enable_sam_decoding, "
                           "0001-vllm_ascend-feature-bs_threshold_for_spec_decode, "
                           "0002-vllm_ascend-feature-enable_sam_decoding",
                  verified=Verified(
                      cpu_runtime="real vLLM engines (0.13, 0.23) with the SAM drafter: token "
                                  "identity with no speculation, flags through the environment",
                      doubles="vLLM-Ascend proposer selection against a runner double; 0.23 "
                              "recovered-token sampler vs the upstream function compiled from source",
                      static="vLLM-Ascend hook points (0.13, 0.23)"),
                  stacks="recipe, current")

_VLLM = ">=0.13,<0.24"


def _sam_requested(vllm_config) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and getattr(spec, "model", None) == "sam"


# -- config: method "sam" -> method "ngram", model "sam" ---------------------------------------

@FEATURE.before("vllm.engine.arg_utils:EngineArgs.create_speculative_config", name="sam.accept_method_sam", dist="vllm",
                versions=_VLLM, params=("self",),
                reason="vLLM's SpeculativeMethod literal has no 'sam'; map it to ngram+model "
                       "'sam' before validation so vLLM's checks stay intact",
                remove_when="every supported vLLM selects a proposer class by name "
                            "(method='custom_class', in vLLM 0.23) and passes it request ids",
                upstream="https://github.com/vllm-project/vllm/pull/39487",
                replaces="recipe vLLM patch 0002 (SpeculativeConfig.__post_init__ edit)")
def _rewrite_sam_method(instance, args, kwargs):
    from .vllm_proposer import SAM_MODEL_NAME, rewrite_speculative_dict
    instance.speculative_config = rewrite_speculative_dict(instance.speculative_config)
    if getattr(instance, "spec_method", None) == SAM_MODEL_NAME:  # 0.23 --spec-method sam
        instance.spec_method = "ngram"
        if getattr(instance, "spec_model", None) is None:
            instance.spec_model = SAM_MODEL_NAME
    return None


# -- proposer selection in vLLM's GPU/CPU model runner ----------------------------------------

@FEATURE.wrap("vllm.v1.spec_decode.ngram_proposer:NgramProposer", name="sam.select_sam_proposer", dist="vllm", versions=_VLLM,
              order=20,
              reason="the model runner builds NgramProposer(vllm_config) for method 'ngram'; "
                     "return the SAM proposer (a NgramProposer subclass) when model == 'sam'",
              remove_when="every supported vLLM selects a proposer class by name "
                          "(method='custom_class', in vLLM 0.23) and passes it request ids",
              upstream="https://github.com/vllm-project/vllm/pull/39487",
              replaces="recipe vLLM patch 0002 / sam_proposer.py")
def _ngram_or_sam(wrapped, instance, args, kwargs):
    vllm_config = args[0] if args else kwargs.get("vllm_config")
    if _sam_requested(vllm_config):
        from .vllm_proposer import make_sam_proposer
        return make_sam_proposer(wrapped, vllm_config)
    return wrapped(*args, **kwargs)


@FEATURE.before("vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
                name="sam.bind_input_batch", dist="vllm", versions=_VLLM, params=("self",),
                reason="vLLM 0.23's ngram propose() gets no request ids; SAM keys its automata "
                       "by request id and groups siblings by prompt, so it reads input_batch; "
                       "its history keeps only finished responses, so it reads each request's "
                       "stop conditions from the runner's requests (both versions)",
                remove_when="the ngram/custom proposer call passes request ids, prompt lengths "
                            "and which requests finished by themselves")
def _bind_input_batch(instance, args, kwargs):
    drafter = getattr(instance, "drafter", None)
    bind = getattr(drafter, "bind_runner", None)
    if bind is not None:
        bind(instance)
    return None


@FEATURE.replace("vllm.v1.engine.core_client:InprocClient.get_output", name="sam.inproc_client_post_step", dist="vllm",
                 versions=">=0.13,<0.14", params=("self",),
                 fixed_upstream="vLLM 0.23 (InprocClient.get_output calls post_step)",
                 reason="vLLM 0.13's in-process engine client (VLLM_ENABLE_V1_MULTIPROCESSING=0, "
                        "verl's spmd rollout) never calls EngineCore.post_step, so drafts are "
                        "proposed but never handed to the scheduler: no speculation at all",
                 remove_when="running vLLM >= 0.23")
def _inproc_get_output(self):
    outputs, model_executed = self.engine_core.step_fn()
    self.engine_core.post_step(model_executed=model_executed)
    if outputs and 0 in outputs:
        return outputs[0]
    from vllm.v1.engine import EngineCoreOutputs
    return EngineCoreOutputs()


# -- batch-size switch in the scheduler ----------------------------------------------------------

def _threshold_active() -> bool:
    return bool(ENABLE.value) and BATCH_THRESHOLD.value > 0


@FEATURE.before("vllm.v1.core.sched.scheduler:Scheduler.schedule", name="sam.batch_size_switch", dist="vllm", versions=_VLLM,
                params=("self",), enabled_by=_threshold_active,
                reason="speculate only in the long tail: when more requests than the threshold "
                       "will run, drop pending SAM drafts so the step is a plain decode step",
                remove_when="vLLM has a batch-size switch for speculative decoding in V1",
                replaces="recipe vLLM-Ascend patch 0001 (VLLM_SPECULATIVE_BATCH_SIZE_THRE)")
def _sam_batch_switch(instance, args, kwargs):
    spec = getattr(getattr(instance, "vllm_config", None), "speculative_config", None)
    if spec is None or getattr(spec, "model", None) != "sam":
        return None
    from .scheduler_switch import drop_drafts_over_threshold
    drop_drafts_over_threshold(instance, BATCH_THRESHOLD.value)
    return None


# -- vLLM-Ascend --------------------------------------------------------------------------------------

@FEATURE.wrap("vllm_ascend.worker.model_runner_v1:NPUModelRunner._get_drafter", name="sam.ascend_select_sam_proposer", dist="vllm-ascend",
              versions=">=0.13,<0.24", order=20, params=("self",),
              reason="vLLM-Ascend picks its proposer from the method ('ngram' after the rewrite); "
                     "return the SAM proposer when speculative_config.model == 'sam'",
              remove_when="vLLM-Ascend ships a reachable SAM proposer, or selects a proposer "
                          "class by name (custom_class) on every supported version",
              upstream="https://github.com/vllm-project/vllm-ascend/pull/15710",
              replaces="recipe vLLM-Ascend patch 0002 (get_spec_decode_method 'sam' branch)")
def _ascend_get_drafter(wrapped, instance, args, kwargs):
    if _sam_requested(getattr(instance, "vllm_config", None)):
        from .ascend import make_ascend_sam_proposer
        return make_ascend_sam_proposer(instance)
    return wrapped(*args, **kwargs)


# -- vLLM-Ascend 0.23: recovered tokens of model-free drafts under reduce sampling ------------------

_RECOVERED_PARAMS = ("output_token_ids", "cu_num_draft_tokens", "draft_token_ids", "draft_probs",
                     "target_probs", "q", "vocab_size", "IS_NGRAM", "target_indices",
                     "enable_reduce_sampling")


def _ngram_reduced_or_upstream(implementation: str, wrapped, args, kwargs):
    """Run ``ascend_sampler.<implementation>`` for model-free drafts under reduce sampling,
    vLLM-Ascend's own function for everything else."""
    bound = dict(zip(_RECOVERED_PARAMS, args))
    bound.update(kwargs)
    if not (bound.get("IS_NGRAM") and bound.get("enable_reduce_sampling")):
        return wrapped(*args, **kwargs)
    from . import ascend_sampler
    return getattr(ascend_sampler, implementation)(
        bound["output_token_ids"], bound["cu_num_draft_tokens"], bound["draft_token_ids"],
        bound["target_probs"], bound["q"], bound["target_indices"])


@FEATURE.wrap("vllm_ascend.sample.rejection_sampler:sample_recovered_tokens_pytorch",
              name="sam.ascend_vectorized_recovered_tokens", dist="vllm-ascend", versions=">=0.23,<0.24", order=20, params=_RECOVERED_PARAMS,
              reason="with reduce sampling, model-free drafts (SAM, n-gram) zero each draft "
                     "token among its candidates in a Python loop with one host sync per draft "
                     "token; do it in one masked tensor op",
              remove_when="vLLM-Ascend vectorizes the IS_NGRAM reduce-sampling branch",
              replaces="the recipe's vectorized rejection sampler for vLLM-Ascend")
def _ascend_recovered_tokens(wrapped, instance, args, kwargs):
    return _ngram_reduced_or_upstream("recovered_tokens_ngram_reduced", wrapped, args, kwargs)


@FEATURE.wrap("vllm_ascend.sample.rejection_sampler:sample_recovered_tokens_blockwise_pytorch",
              name="sam.ascend_vectorized_recovered_tokens_blockwise", dist="vllm-ascend", versions=">=0.23,<0.24", order=20, params=_RECOVERED_PARAMS,
              reason="block verification (num_speculative_tokens >= 3) has the same per-draft-"
                     "token loop for model-free drafts under reduce sampling",
              remove_when="vLLM-Ascend vectorizes the IS_NGRAM reduce-sampling branch",
              replaces="the recipe's vectorized rejection sampler for vLLM-Ascend")
def _ascend_recovered_tokens_blockwise(wrapped, instance, args, kwargs):
    return _ngram_reduced_or_upstream("recovered_tokens_ngram_reduced_blockwise", wrapped, args,
                                      kwargs)
