"""The CPU demo's evidence that SAM drafted: vLLM's speculative-decoding counters."""

from ascend_rl_plugins.devtools.demo import drafting


def test_the_demo_reports_what_sam_drafted_from_vllms_counters():
    line, drafted = drafting({"vllm:spec_decode_num_drafts": 217, "vllm:spec_decode_num_draft_tokens": 566,
                              "vllm:spec_decode_num_accepted_tokens": 430})
    assert drafted and line.startswith("SAM drafted 566 tokens in 217 drafts; the model accepted 430 (76%)")


def test_no_draft_fails_the_demo_and_missing_counters_are_said_not_guessed():
    assert drafting({"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_draft_tokens": 0,
                     "vllm:spec_decode_num_accepted_tokens": 0})[1] is False
    line, drafted = drafting({"unavailable": "no get_metrics"})
    assert drafted and "unavailable" in line
