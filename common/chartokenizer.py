"""A character-level tokenizer for the tiny base model, built with ``tokenizers``, saved as HF.

One token per byte and no merges, so every character of the synthetic tasks (digits, letters,
'=', newline) is its own token and a running sum is spelled out step by step.

Why byte-level BPE rather than a plain character vocabulary: transformers 5 loads the tokenizer of
any directory whose config says ``model_type: qwen2`` as ``Qwen2Tokenizer``, which rebuilds the
pipeline (byte-level BPE, Qwen's pre-tokenizer regex) from the saved vocab and merges and ignores the
rest of tokenizer.json. A byte-level vocabulary with no merges tokenizes identically under both
pipelines, so ``AutoTokenizer.from_pretrained(model_dir)`` gives exactly the tokenizer trained with.
No BOS is added on encode (Qwen2Tokenizer would not add one either); prompts start with a fixed
task word, which serves as the attention sink.
"""
from __future__ import annotations

from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins ByteLevel uses for bytes, in byte order."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Recreate ByteLevel's byte -> symbol table: printable Latin-1 bytes map to themselves, the
    # others to consecutive code points from 256 up, in byte order.
    keep = [b for b in range(256) if chr(b) in alphabet and b not in range(127, 161) and b != 173
            and b > 32]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    assert set(table.values()) == set(alphabet), "ByteLevel alphabet changed"
    return [table[b] for b in range(256)]


def build_char_tokenizer(pad: bool = True, extra_specials: tuple[str, ...] = ()):
    """A fast tokenizer: one token per byte, <eos>/<pad>/<bos>/<unk> specials, exact decode.

    ``pad=False`` leaves the pad token unset (as Llama-3's tokenizer does; ``<pad>`` keeps id 0, so
    ids do not move); ``extra_specials`` are appended after the 260 byte ids (e.g. an end-of-turn
    token that a chat template and ``generation_config.eos_token_id`` name)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + _byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False,
                               byte_fallback=False))
    # The same pipeline Qwen2Tokenizer builds; with no merges its regex only decides grouping,
    # which cannot change a per-byte tokenization.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD if pad else None,
        unk_token=UNK, clean_up_tokenization_spaces=False, padding_side="left",
        model_max_length=4096)
    if extra_specials:
        out.add_special_tokens({"additional_special_tokens": list(extra_specials)})
    return out


def save_char_tokenizer(out_dir: str | Path, **kw):
    """Build the tokenizer (``build_char_tokenizer(**kw)``), ``save_pretrained`` it into
    ``out_dir``; returns it."""
    tok = build_char_tokenizer(**kw)
    tok.save_pretrained(str(out_dir))
    return tok
