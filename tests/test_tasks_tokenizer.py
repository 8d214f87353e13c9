"""The character tokenizer: exact round trips, one token per character, HF save/load as Qwen2."""
from __future__ import annotations

import json

import pytest

from tasks.tokenizer import build_char_tokenizer, save_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.mark.parametrize("text", ["sum a3b1c4d1e5\n", "a3b4c8d9e14=14", "  x\n\n y ", "",
                                  "rev 0123\n", "ünïcode € \t"])
def test_round_trip(tok, text):
    ids = tok(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_one_token_per_ascii_char_and_specials(tok):
    text = "sum a3b1\n"
    assert len(tok(text)["input_ids"]) == len(text)
    assert tok(text, add_special_tokens=False)["input_ids"] == tok(text)["input_ids"]
    ids = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}
    assert len(ids) == 4 and None not in ids
    assert tok.decode(tok("ab")["input_ids"] + [tok.eos_token_id], skip_special_tokens=True) == "ab"
    assert tok.padding_side == "left"


def test_reload_in_a_qwen2_model_dir_is_identical(tok, tmp_path):
    # transformers 5 loads a qwen2 directory's tokenizer as Qwen2Tokenizer: it must encode the same.
    from transformers import AutoTokenizer

    save_char_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in ["sum a3b1c4d1e5\n", "a3b4c8d9e14=14 x", "é€\n\n"]:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    batch = loaded(["a", "abc"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2      # left padding for generation
