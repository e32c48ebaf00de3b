"""A tiny Qwen3 (dense, or Qwen3-MoE with ``moe=True``) with random weights and a locally
trained byte-level BPE tokenizer (``chatml=True``: with Qwen's ChatML tokens and template).

Nothing is downloaded: the tokenizer is trained in a second on Python's own standard
library sources, the weights are drawn from a seeded generator. The directory is cached
(keyed by every parameter) so tests and benchmarks share it.

The MoE variant (``build_moe`` / ``cached(moe=True)``) writes its tensors itself in the
per-expert Hugging Face layout (``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``,
the names vLLM's ``Qwen3MoeForCausalLM.load_weights`` and verl's converters use) instead of
going through transformers' model class: transformers 5 keeps experts fused in memory, and
the checkpoint must be the same on both reference stacks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile

MOE_DEFAULTS = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=512,
                    num_experts=8, num_experts_per_tok=2, max_position_embeddings=8192)
DEFAULTS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=64, vocab_size=512, max_position_embeddings=8192)


def corpus_files(limit: int = 200) -> list[str]:
    """Local text present on every machine: the standard library's sources."""
    stdlib = sysconfig.get_paths()["stdlib"]
    out = []
    for name in sorted(os.listdir(stdlib)):
        if name.endswith(".py"):
            out.append(os.path.join(stdlib, name))
        if len(out) >= limit:
            break
    return out


# Qwen's ChatML turn format (role header, content, end-of-turn marker), for models built with
# ``chatml=True``: verl 0.9's agent loop picks its token-boundary rules by model_type and, for
# qwen3, requires the tokenizer to define ``<|im_end|>``.
CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def train_tokenizer(out_dir: str, vocab_size: int, chatml: bool = False) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<|endoftext|>"] + (CHATML_TOKENS if chatml else []),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train(corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    if chatml:
        fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out_dir)


def build(out_dir: str, seed: int = 0, dtype: str = "bfloat16", chatml: bool = False, **overrides) -> str:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(DEFAULTS, **overrides)
    config = Qwen3Config(**cfg, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         torch_dtype=dtype, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:
        json.dump({"eos_token_id": 0, "do_sample": False}, fh)
    train_tokenizer(out_dir, cfg["vocab_size"], chatml)
    return out_dir


def moe_tensors(cfg: dict, seed: int, dtype: str) -> dict:
    """Every tensor of a Qwen3-MoE checkpoint with ``cfg``'s sizes, in the HF per-expert layout,
    drawn from ``seed`` (std 0.02 like the usual init; RMSNorm weights around 1 so that a wrong
    norm cannot go unnoticed)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, heads, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter, experts, vocab = cfg["moe_intermediate_size"], cfg["num_experts"], cfg["vocab_size"]

    def rand(*shape, std=0.02):
        return (torch.randn(shape, generator=g) * std).to(getattr(torch, dtype))

    def norm(n):
        return (1.0 + torch.randn((n,), generator=g) * 0.1).to(getattr(torch, dtype))

    out = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": norm(h),
           "lm_head.weight": rand(vocab, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out.update({p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
                    p + "self_attn.q_proj.weight": rand(heads * hd, h),
                    p + "self_attn.k_proj.weight": rand(kv * hd, h),
                    p + "self_attn.v_proj.weight": rand(kv * hd, h),
                    p + "self_attn.o_proj.weight": rand(h, heads * hd),
                    p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                    p + "mlp.gate.weight": rand(experts, h, std=0.2)})
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            out.update({q + "gate_proj.weight": rand(inter, h), q + "up_proj.weight": rand(inter, h),
                        q + "down_proj.weight": rand(h, inter)})
    return out


def write_moe_checkpoint(out_dir: str, tensors: dict) -> None:
    """``tensors`` as the model's safetensors file (the rest of ``out_dir`` is left alone)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})


def copy_model_files(src_dir: str, out_dir: str) -> None:
    """Every file of the model in ``src_dir`` except its weights (config, tokenizer, generation
    config) into ``out_dir``: a second checkpoint of the same model with other weights needs
    them, and vLLM / transformers read them from the weights' directory. ``cached``'s
    completion marker stays behind."""
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(src_dir):
        path = os.path.join(src_dir, name)
        if not name.endswith(".safetensors") and name != ".done" and os.path.isfile(path):
            shutil.copy(path, os.path.join(out_dir, name))


def build_moe(out_dir: str, seed: int = 0, dtype: str = "bfloat16", **overrides) -> str:
    """A tiny Qwen3-MoE (every layer sparse, no shared expert) in ``out_dir``."""
    from transformers import Qwen3MoeConfig

    cfg = dict(MOE_DEFAULTS, **overrides)
    config = Qwen3MoeConfig(**cfg, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                            torch_dtype=dtype, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    config.architectures = ["Qwen3MoeForCausalLM"]
    write_moe_checkpoint(out_dir, moe_tensors(cfg, seed, dtype))
    config.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:
        json.dump({"eos_token_id": 0, "do_sample": False}, fh)
    train_tokenizer(out_dir, cfg["vocab_size"])
    return out_dir


def cached(seed: int = 0, dtype: str = "bfloat16", moe: bool = False, chatml: bool = False,
           **overrides) -> str:
    """Path of the tiny model for these parameters, built once per machine (``moe=True``: the
    Qwen3-MoE variant; ``chatml=True``: a dense model whose tokenizer has Qwen's ChatML tokens
    and template; the other models' cache keys are unchanged by these options)."""
    from ..doctor import cache_dir

    import transformers

    # transformers 4.x cannot read the tokenizer config 5.x writes (and weight init may
    # differ): one model per transformers major version, so both stacks share a cache
    major = transformers.__version__.split(".")[0]
    fields = [seed, dtype, sorted(overrides.items()), 1, major] + (["moe", 1] if moe else []) + (["chatml", 1] if chatml else [])
    key = hashlib.sha1(json.dumps(fields).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir(), "models", f"tiny-qwen3{'-moe' if moe else ''}-{key}")
    if os.path.exists(os.path.join(path, ".done")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".build-")
    try:
        if moe:
            build_moe(tmp, seed=seed, dtype=dtype, **overrides)
        else:
            build(tmp, seed=seed, dtype=dtype, chatml=chatml, **overrides)
        open(os.path.join(tmp, ".done"), "w").close()
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":
    print(cached())
