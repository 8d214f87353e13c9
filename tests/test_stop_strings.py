"""Stop strings: the native engine ends a row with the token that completes one (finish "stop"),
log-probs stay aligned with the response, and the config validates ``rollout.stop``."""
from __future__ import annotations

import pytest
import torch

from actors.config import KVConfig, RolloutConfig
from actors.engine import SamplingParams
from actors.native import NativeEngine
from actors.native.stops import StopMatcher
from common.testmodels import VLLM_CPU, build_model, model_config
from common.errors import ConfigError
from common.modeling import load_model, load_tokenizer

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # larger init std than HF's: greedy continuations vary instead of repeating one character;
    # vocab 131 = the char tokenizer's 4 specials + bytes 0-126: every token decodes to one ASCII
    # character and none to \x7f (the impossible stop string below)
    return build_model(tmp_path_factory.mktemp("stops"), seed=0, **VLLM_CPU, vocab_size=131)


def first_completion(decode, ids, stop) -> int | None:
    """Definition, by brute force: number of tokens up to the one completing the first stop."""
    for k in range(1, len(ids) + 1):
        if stop in decode(ids[:k]):
            return k
    return None


@pytest.mark.parametrize("policy", ["dense", "streaming", "snapkv"])
def test_native_stops_at_the_completing_token(model_dir, policy):
    tok = load_tokenizer(model_dir)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    kv = KVConfig(policy=policy, budget=8, compress_every=4, sink_tokens=2, obs_window=4)
    eng = NativeEngine(load_model(model_dir), kv, batch_size=2)   # 3 prompts: a refill happens
    greedy = dict(max_new_tokens=40, temperature=0.0)
    full = eng.generate(PROMPTS, SamplingParams(**greedy))
    ref = full[0].response_ids
    stop = decode(ref[20:23])                        # ~3 characters from the middle of row 0
    assert len(stop) >= 2 and stop not in decode(ref[:20])
    outs = eng.generate(PROMPTS, SamplingParams(**greedy, stop=(stop, "\x7f\x7f\x7f")))
    for f, o in zip(full, outs):
        cut = first_completion(decode, f.response_ids, stop)
        n = cut if cut is not None else len(f.response_ids)
        assert o.response_ids == f.response_ids[:n]
        assert o.logprobs == pytest.approx(f.logprobs[:n], abs=1e-5)
        assert len(o.logprobs) == len(o.response_ids)
        assert o.finish_reason == ("stop" if cut is not None else "length")
    assert outs[0].finish_reason == "stop" and len(outs[0].response_ids) <= 23
    assert decode(outs[0].response_ids).endswith(stop)


def test_from_config_loads_the_tokenizer_and_sampled_rows_stop(model_dir):
    cfg = RolloutConfig(model_path=str(model_dir), batch_size=4)
    eng = NativeEngine.from_config(cfg, str(model_dir))
    tok = load_tokenizer(model_dir)
    outs = eng.generate(PROMPTS * 2, SamplingParams(max_new_tokens=60, temperature=1.0, seed=0,
                                                    stop=("a", "b", "c", "d", "e")))
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped                                    # 5 of ~95 characters in 60 sampled tokens
    for o in outs:
        text = tok.decode(o.response_ids, skip_special_tokens=True)
        assert len(o.logprobs) == len(o.response_ids)
        hits = [i for i, ch in enumerate(text) if ch in "abcde"]
        if o.finish_reason == "stop":
            assert hits == [len(text) - 1]            # only at the very end
        else:
            assert not hits and len(o.response_ids) == 60


def test_matcher_multibyte_and_long_history():
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    m = StopMatcher(["é!"], decode)
    text = ("x" * 100 + "é" + "y" + "é!").encode()
    hits = [m.hits([7], [b])[0] for b in text]
    assert hits.index(True) == len(text) - 1 and sum(hits) == 1
    assert len(m.history[7]) <= 2 * m.window


def test_engine_without_tokenizer_says_so():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(model_config())     # no directory behind it
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        NativeEngine(model).generate([[5, 6]], SamplingParams(max_new_tokens=2, stop=("a",)))


@pytest.mark.parametrize("bad", ["abc", [""], [3], ["ok", None]])
def test_config_rejects_bad_stop(bad):
    with pytest.raises(ConfigError, match="rollout.stop"):
        RolloutConfig(stop=bad).validate()
    RolloutConfig(stop=["\n\n", "="]).validate()
