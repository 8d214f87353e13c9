"""Stop strings for the native engine: which sampled token completes one of ``SamplingParams.stop``.

The engine works on token ids, so a stop string is found by decoding. Each live row keeps its response
ids on the host; after every step the last ``window`` tokens are decoded and searched. Checking at every
step means a match inside the tail that did not end at the newest token was already seen the step
before, so a hit always means "this token completed a stop string" (as in vLLM, the token completing
it is kept, and the rest of the text after the stop string, if that token carried more, stays too).
``window`` covers the longest stop string in UTF-8 bytes (a token decodes to at least one byte) plus
slack for a leading partial character or a decoder that strips a leading space. Only the response is
searched, never the prompt. Decoding skips special tokens, as the reward's decode does
(docs/INTERFACES.md, "Tasks").
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

TAIL_SLACK = 8


def tokenizer_decoder(path) -> Callable[[list[int]], str]:
    """``ids -> text`` with the HF tokenizer of the model directory at path (loaded on first use, so
    engines that never see a stop string never load a tokenizer)."""
    tok = None

    def decode(ids: list[int]) -> str:
        nonlocal tok
        if tok is None:
            from common.modeling import load_tokenizer

            tok = load_tokenizer(path)
        return tok.decode(ids, skip_special_tokens=True)

    return decode


class StopMatcher:
    """Per-row response history and the stop-string test (one instance per ``generate`` call)."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]):
        self.stops = tuple(stops)
        self.decode = decode
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + TAIL_SLACK
        self.history: dict[int, list[int]] = {}

    def hits(self, ids: list[int], tokens: list[int]) -> list[bool]:
        """Append tokens[j] to the response of prompt ids[j]; True where it completes a stop."""
        out = []
        for o, t in zip(ids, tokens):
            h = self.history.setdefault(o, [])
            h.append(t)
            if len(h) > 2 * self.window:        # only the tail is ever decoded
                del h[:-self.window]
            tail = self.decode(h[-self.window:])
            out.append(any(s in tail for s in self.stops))
        return out
