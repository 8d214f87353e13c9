"""Random-weight models of real architecture families, shrunk, for tests and benchmarks.

The one test-model builder of the project. Every family is built from transformers' own config class
(nothing is downloaded) with the features that make the real family differ from the others:

| family    | class        | what it exercises                                                       |
|-----------|--------------|-------------------------------------------------------------------------|
| "tiny"    | Qwen2Config  | today's 2-layer test model (tied embeddings, GQA 2)                     |
| "qwen2.5" | Qwen2Config  | q/k/v biases, tied embeddings, rope_theta 1e6, GQA 3                    |
| "qwen3"   | Qwen3Config  | q/k RMSNorm, head_dim 32 != hidden / heads = 16, tied embeddings        |
| "llama3"  | LlamaConfig  | llama3 RoPE scaling, untied lm_head, no pad token, eos list [eos, eot]  |
|           |              | in generation_config.json, a chat template; GQA 4                       |
| "gqa"     | Qwen2Config  | GQA 4 (4 query heads per KV head), head_dim 32                          |

``random_model(family, device, dtype, seed, **overrides)`` builds the same model in memory, directly
on ``device`` in ``dtype`` (nothing written: benchmarks of public shapes, e.g. Qwen2.5-1.5B on a
GPU, in ``bench/rollout_gpu.py``).
``build_model(out_dir, family, seed, tokenizer=True, **overrides)`` saves the weights, the project's
character tokenizer (``common/chartokenizer.py``; the llama3 family's has no pad token, an extra ``<eot>``
special and a Llama-3-style chat template) and HF's ``generation_config.json``. Overrides use the HF
config's own key names (``hidden_size``, ``num_key_value_heads``, ...); a ``vocab_size`` below the
tokenizer's 260 ids keeps generation among the first ones (131: bytes 0-126, one ASCII character per
token), for prompts of those ids only. ``VLLM_CPU`` holds the
overrides vLLM's CPU attention needs (head_dim = hidden / heads >= 32) plus a larger init std, so
greedy continuations vary instead of repeating one token.
"""
from __future__ import annotations

from pathlib import Path

import torch

# 4 specials + 256 byte tokens (common/chartokenizer.py); the llama3 family appends <eot> as id 260.
CHAR_VOCAB = 260
EOT = "<eot>"
EOT_ID = CHAR_VOCAB

# Llama-3's template shape with the char tokenizer's specials: <bos>, a header per turn, <eot>.
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<eot>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=CHAR_VOCAB, bos_token_id=1, eos_token_id=2,
               pad_token_id=0, tie_word_embeddings=True)

FAMILIES: dict[str, tuple[str, dict]] = {
    "tiny": ("qwen2", dict(_COMMON, max_position_embeddings=16384, use_sliding_window=False)),
    "qwen2.5": ("qwen2", dict(_COMMON, hidden_size=96, intermediate_size=192,
                              num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-6,
                              max_position_embeddings=32768, use_sliding_window=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("qwen3", dict(_COMMON, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=40960,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # original_max_position_embeddings is shrunk with the model so the scaling (wavelengths above
    # 64 / low_freq_factor are divided by factor) changes frequencies the tests' lengths reach.
    "llama3": ("llama", dict(_COMMON, intermediate_size=160, num_key_value_heads=1,
                             vocab_size=CHAR_VOCAB + 1, eos_token_id=[2, EOT_ID], pad_token_id=None,
                             tie_word_embeddings=False, max_position_embeddings=512,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                              "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})),
    "gqa": ("qwen2", dict(_COMMON, hidden_size=128, intermediate_size=256, num_key_value_heads=1,
                          max_position_embeddings=4096, use_sliding_window=False)),
}

VLLM_CPU = dict(num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2,
                max_position_embeddings=2048)


def model_config(family: str = "tiny", **overrides):
    """The family's transformers config object, with ``overrides`` (HF key names) applied."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family not in FAMILIES:
        raise ValueError(f"unknown test-model family {family!r}; known: {sorted(FAMILIES)}")
    model_type, kw = FAMILIES[family]
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[model_type]
    return cls(**{**kw, **overrides})


def tokenizer_for(family: str = "tiny"):
    """The char tokenizer as the family ships it (see the module docstring)."""
    from common.chartokenizer import build_char_tokenizer

    if family == "llama3":
        tok = build_char_tokenizer(pad=False, extra_specials=(EOT,))
        tok.chat_template = LLAMA3_CHAT_TEMPLATE
        return tok
    return build_char_tokenizer()


def build_model(out_dir: str | Path, family: str = "tiny", seed: int = 0, tokenizer: bool = True,
                **overrides) -> Path:
    """Save a random-weight ``family`` model (and its tokenizer unless ``tokenizer=False``) to
    ``out_dir`` with ``save_pretrained``; returns the path. Weights are a function of ``seed``."""
    from transformers import AutoModelForCausalLM

    cfg = model_config(family, **overrides)
    out = Path(out_dir)
    if tokenizer:
        tokenizer_for(family).save_pretrained(str(out))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(out))   # also writes generation_config.json (eos ids from cfg)
    return out


def random_model(family: str = "tiny", device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A random-weight ``family`` model with ``overrides``, in eval mode, built in memory directly
    on ``device`` in ``dtype``. Creating the parameters there (instead of on the CPU and moving
    them) spares a multi-GB host copy and a CPU-speed init; HF's own init (normal with std
    ``initializer_range``, 0.02) then runs on the device from ``seed``."""
    from transformers import AutoModelForCausalLM

    cfg = model_config(family, **overrides)
    torch.manual_seed(seed)   # seeds the CUDA generators too
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()
