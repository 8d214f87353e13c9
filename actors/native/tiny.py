"""Random-weight models of the supported architectures, for tests and the benchmark.

``build_tiny(out_dir, arch="qwen2", ...)`` saves an HF model directory with a character-level
tokenizer (ids: 0 pad, 1 bos, 2 eos, 3 unk, then printable ASCII), so the rollout actor can be tested
without the project's base model.
"""
from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def char_tokenizer():
    """PreTrainedTokenizerFast over single printable ASCII characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def tiny_config(arch: str = "qwen2", hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, vocab: int = 128, intermediate: int | None = None,
                max_pos: int = 16384):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    kw = dict(hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              vocab_size=vocab, max_position_embeddings=max_pos, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=True)
    if arch == "qwen3":
        kw["head_dim"] = hidden // heads
    return cls(**kw)


def build_tiny(out_dir: str | Path, arch: str = "qwen2", seed: int = 0, **cfg_kw) -> Path:
    """Save a random-weight model (and the char tokenizer) to out_dir; returns the path."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **cfg_kw))
    model.save_pretrained(str(out))
    char_tokenizer().save_pretrained(str(out))
    return out
