"""The synthetic tasks' tokenizer: the project's character tokenizer (``common/chartokenizer.py``,
where the test-model builder reads it too)."""
from common.chartokenizer import (  # noqa: F401
    BOS, EOS, PAD, SPECIALS, UNK, build_char_tokenizer, save_char_tokenizer)
