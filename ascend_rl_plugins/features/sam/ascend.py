"""SAM proposer for vLLM-Ascend's NPU model runner (vllm-ascend 0.13 and 0.23).

vLLM-Ascend picks its drafter in ``NPUModelRunner._get_drafter``; the wrapper there calls
:func:`make_ascend_sam_proposer` when ``speculative_config.model == "sam"``. The returned
object subclasses the installed version's Ascend n-gram proposer, so the runner's dispatch
(``method == "ngram"`` in 0.13: ``generate_token_ids``; ``isinstance(..., AscendNgramProposer)``
in 0.23: ``propose``) reaches it unchanged:

* 0.13: ``vllm_ascend.spec_decode.ngram_proposer.NgramProposer(vllm_config, device, runner)``
  with ``generate_token_ids(valid_sampled_token_ids, ...)``;
* 0.23: ``vllm_ascend.spec_decode.ngram_proposer.AscendNgramProposer(vllm_config, runner)``
  with ``propose(sampled_token_ids, num_tokens_no_spec=None, token_ids_cpu=None, ...)``
  (on other vLLM versions ``propose(num_speculative_tokens, sampled_token_ids, ...)``).
The base constructors are not called: they only size and JIT-warm the n-gram kernel.
"""

from __future__ import annotations

import importlib

from .vllm_proposer import _SamProposerMixin

_CLASSES: dict[type, type] = {}


def _ascend_ngram_base():
    mod = importlib.import_module("vllm_ascend.spec_decode.ngram_proposer")
    if hasattr(mod, "AscendNgramProposer"):
        return mod.AscendNgramProposer, "0.23"
    return mod.NgramProposer, "0.13"


class _AscendSamMixin(_SamProposerMixin):
    runner = None

    def _ascend_batch(self):
        batch = self.runner.input_batch
        self.input_batch = batch
        return batch

    def _draft(self, sampled_token_ids):
        b = self._ascend_batch()
        return self.propose_for(sampled_token_ids, b.req_ids, b.num_tokens_no_spec,
                                b.token_ids_cpu, getattr(b, "spec_decode_unsupported_reqs", ()))

    # vllm-ascend 0.13
    def generate_token_ids(self, valid_sampled_token_ids, *args, **kwargs):
        return self._draft(valid_sampled_token_ids)

    # vllm-ascend 0.23
    def propose(self, *args, **kwargs):
        sampled = kwargs.get("sampled_token_ids")
        if sampled is None:
            sampled = args[1] if args and isinstance(args[0], int) else args[0]
        return self._draft(sampled)

    def dummy_run(self, *args, **kwargs):
        pass


def ascend_sam_class(base: type, flavour: str) -> type:
    cls = _CLASSES.get(base)
    if cls is None:
        if flavour == "0.13":
            def __init__(self, vllm_config, device, runner):
                from vllm_ascend.spec_decode.interface import SpecDcodeType
                self.name = SpecDcodeType.NGRAM  # SpecDcodeType has no SAM member
                self.device = device
                self.runner = runner
                self._init_sam(vllm_config)
        else:
            def __init__(self, vllm_config, runner):
                self.runner = runner
                self._init_sam(vllm_config)
        cls = type("AscendSamProposer", (_AscendSamMixin, base), {
            "__init__": __init__, "__module__": __name__,
            "__doc__": f"SAM drafter presented as vLLM-Ascend {flavour}'s n-gram proposer."})
        _CLASSES[base] = cls
    return cls


def make_ascend_sam_proposer(runner):
    base, flavour = _ascend_ngram_base()
    cls = ascend_sam_class(base, flavour)
    if flavour == "0.13":
        return cls(runner.vllm_config, runner.device, runner)
    return cls(runner.vllm_config, runner)
