"""A tiny Qwen3 with random weights and a locally trained byte-level BPE tokenizer.

Nothing is downloaded: the tokenizer is trained in a second on Python's own standard
library sources, the weights are drawn from a seeded generator. The directory is cached
(keyed by every parameter) so tests and benchmarks share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile

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


def train_tokenizer(out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train(corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    fast.save_pretrained(out_dir)


def build(out_dir: str, seed: int = 0, dtype: str = "bfloat16", **overrides) -> str:
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
    train_tokenizer(out_dir, cfg["vocab_size"])
    return out_dir


def cached(seed: int = 0, dtype: str = "bfloat16", **overrides) -> str:
    """Path of the tiny model for these parameters, built once per machine."""
    from ..doctor import cache_dir

    import transformers

    # transformers 4.x cannot read the tokenizer config 5.x writes (and weight init may
    # differ): one model per transformers major version, so both stacks share a cache
    major = transformers.__version__.split(".")[0]
    key = hashlib.sha1(json.dumps([seed, dtype, sorted(overrides.items()), 1, major]).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir(), "models", f"tiny-qwen3-{key}")
    if os.path.exists(os.path.join(path, ".done")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".build-")
    try:
        build(tmp, seed=seed, dtype=dtype, **overrides)
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
