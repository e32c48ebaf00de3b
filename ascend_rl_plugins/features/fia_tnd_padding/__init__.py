"""FIA TND padding for the main model's full-graph attention parameter update (vLLM-Ascend 0.13).

In TND layout the FIA op needs ``actual_seq_lengths`` to end at the graph's padded token count
and one KV length per request; vLLM-Ascend 0.13's ``_update_attn_fia_params`` pads them for the
draft model only. The function is wrapped: the main model gets a view of the forward context
whose attention metadata are shallow copies with padded lists (the engine's objects are never
mutated). README.md beside this file: why, flags, verified where.

Remove when: the oldest supported vLLM-Ascend pads them itself (0.23 does, in its model runner
and metadata builder).
"""

from __future__ import annotations

from ... import flags
from ...patching import Feature, Verified

ENABLE = flags.define(
    "ASCEND_RL_FIA_TND_PADDING", "bool", False,
    "Pad the main model's FIA TND sequence-length lists to the graph's token count during "
    "full-graph parameter updates (vLLM-Ascend 0.13; fixed upstream in 0.23).",
    feature="fia_tnd_padding")

FEATURE = Feature(
    "fia_tnd_padding", "Pad FIA TND actual_seq_lengths(_kv) of the main model in graph updates.",
    flag=ENABLE,
    replaces="Qwen3 RL recipe vLLM-Ascend patch 0005-vllm_ascend-bugfix-align_FIA_input_for_TND_layout",
    verified=Verified(
        cpu_runtime="padding function property-tested",
        doubles="the real vLLM-Ascend 0.13 _update_attn_fia_params (compiled from source) with "
                "torch/torch_npu doubles",
        static="hook point in vLLM-Ascend 0.13 and 0.23"),
    stacks="recipe (current: fixed upstream)")


def pad_fia_tnd(actual_seq_lengths_q: list[int], seq_lens: list[int], runtime_shape: int,
                step: int = 1) -> tuple[list[int], list[int]]:
    """Cumulative query ends padded to end at ``runtime_shape``, KV lengths padded with 0.

    Dummy requests take ``step`` query tokens each (the last one the remainder), so a
    padded decode batch keeps the shape it was captured with. Inputs are not modified;
    already-padded input is returned as is."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    last = actual_seq_lengths_q[-1] if actual_seq_lengths_q else 0
    if last < runtime_shape:
        tail = list(range(last + step, runtime_shape, step))
        tail.append(runtime_shape)
        actual_seq_lengths_q = actual_seq_lengths_q + tail
    missing = len(actual_seq_lengths_q) - len(seq_lens)
    if missing > 0:
        seq_lens = seq_lens + [0] * missing
    return actual_seq_lengths_q, seq_lens


class _ForwardContextView:
    """The forward context, except for ``attn_metadata`` (padded copies)."""

    def __init__(self, forward_context, attn_metadata):
        self._forward_context = forward_context
        self.attn_metadata = attn_metadata

    def __getattr__(self, name):
        return getattr(self._forward_context, name)


def _padded_metadata(attn_metadata: dict, runtime_shape: int, step: int) -> dict:
    import copy
    copies: dict[int, object] = {}
    out = {}
    for key, meta in attn_metadata.items():
        padded = copies.get(id(meta))
        if padded is None:
            q = getattr(meta, "actual_seq_lengths_q", None)
            kv = getattr(meta, "seq_lens_list", None)
            if q is None or kv is None:
                padded = meta
            else:
                new_q, new_kv = pad_fia_tnd(list(q), list(kv), runtime_shape, step)
                padded = copy.copy(meta)
                padded.actual_seq_lengths_q = new_q
                padded.seq_lens_list = new_kv
            copies[id(meta)] = padded
        out[key] = padded
    return out


_PARAMS = ("update_stream", "forward_context", "runtime_shape", "draft_attn_metadatas", "vllm_config")


@FEATURE.wrap("vllm_ascend.compilation.acl_graph:_update_attn_fia_params", dist="vllm-ascend",
              versions=">=0.13,<0.14", order=60, params=_PARAMS,
              name="fia_tnd_padding.update_attn_fia_params",
              fixed_upstream="vllm-ascend 0.23 (model runner pads query_start_loc with a dummy "
                             "request; metadata builder pads seq_lens_list)",
              reason="FIA in TND layout needs actual_seq_lengths to end at the padded token count; "
                     "va 0.13 pads only the draft model's lists in full-graph updates",
              replaces="recipe vLLM-Ascend patch 0005 (edits the middle of _update_attn_fia_params)",
              remove_when="the oldest supported vLLM-Ascend pads the main model's FIA lists "
                          "(0.23 does, in the model runner and metadata builder)",
              upstream="https://github.com/vllm-project/vllm-ascend/pull/6357")
def _pad_main_model(wrapped, instance, args, kwargs):
    bound = dict(zip(_PARAMS, args))
    bound.update(kwargs)
    forward_context = bound.get("forward_context")
    if forward_context is None or forward_context.is_draft_model or not forward_context.attn_metadata:
        return wrapped(*args, **kwargs)
    vllm_config = bound.get("vllm_config")
    spec = getattr(vllm_config, "speculative_config", None) if vllm_config is not None else None
    step = 1 + (getattr(spec, "num_speculative_tokens", None) or 0)
    view = _ForwardContextView(forward_context, _padded_metadata(
        forward_context.attn_metadata, bound["runtime_shape"], step))
    if len(args) > 1:
        args = (args[0], view) + tuple(args[2:])
    else:
        kwargs = dict(kwargs, forward_context=view)
    return wrapped(*args, **kwargs)
