"""The compaction rule vLLM's scheduler and runner share (actors/vllm/evict/rule.py), against the
native engine it reproduces: the positions it compacts at and the slots it holds. No vLLM needed."""
from __future__ import annotations

import pytest
import torch

from actors.config import KVConfig
from actors.native import NativeEngine
from actors.engine import SamplingParams
from actors.vllm.evict.rule import BudgetTable, CacheLength
from actors.vllm.kv import evicted_kept_ratio
from common.testmodels import build_model
from common.modeling import load_model


def compactions(kv: KVConfig, prompt_len: int, total: int) -> list[tuple[int, int]]:
    """(after = t - 1, budget) of every compaction of a sequence of ``total`` tokens (positions
    up to total - 2 are written: the last sampled token never enters the cache)."""
    cache = CacheLength(BudgetTable(kv), prompt_len)
    out = []
    for t in range(prompt_len, total - 1):
        step = cache.at(t)
        if step.compacts:
            out.append((t - 1, step.length))
    return out


def test_static_budget_closed_form():
    kv = KVConfig(policy="snapkv", budget=10, compress_every=4)
    # short prompt: the cache grows to budget + N = 14, is cut to 10 before writing t = 14,
    # and then every N steps
    assert compactions(kv, 3, 32) == [(13, 10), (17, 10), (21, 10), (25, 10), (29, 10)]
    # a prompt over the budget is cut right after its prefill, before its first decode step
    assert compactions(kv, 12, 22) == [(11, 10), (15, 10), (19, 10)]
    step = CacheLength(BudgetTable(kv), 3).at(14)
    assert (step.held, step.length, step.offset, step.compacts) == (14, 10, 4, True)


def test_positions_only_grow_and_dense_never_compacts():
    cache = CacheLength(BudgetTable(KVConfig(policy="h2o", budget=8, compress_every=2)), 4)
    cache.at(20)
    cache.at(20)                      # the scheduler may ask twice in one step (retries)
    with pytest.raises(ValueError, match="only grow"):
        cache.at(19)
    dense = CacheLength(BudgetTable(KVConfig(policy="dense")), 5)
    assert all(not dense.at(t).compacts and dense.at(t).offset == 0 for t in range(5, 200))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_model(tmp_path_factory.mktemp("rule")))


@pytest.mark.parametrize("kv", [
    KVConfig(policy="snapkv", budget=12, compress_every=5, obs_window=4, pool_kernel=3),
    KVConfig(policy="h2o", budgets=[20, 8, 12], bin_tokens=10, compress_every=4),
    KVConfig(policy="rkv", budget=6, compress_every=3, obs_window=2, pool_kernel=3),
], ids=["snapkv-static", "h2o-bins", "rkv-small"])
def test_rule_matches_native_engine(model, kv):
    """Same compaction points, budgets and kept ratios as the native engine's trace, for prompts
    shorter and longer than the budget."""
    prompts = [[1, 5, 6], [1] + list(range(30, 52)), [1, 9, 10, 11, 12, 13, 14, 15]]
    eng = NativeEngine(model, kv, batch_size=2, trace=True)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0.0))
    for p, o in zip(prompts, outs):
        total = len(p) + len(o.response_ids)
        want = [(after, kept.shape[-1]) for after, kept in o.trace]
        assert compactions(kv, len(p), total) == want
        assert evicted_kept_ratio(len(p), len(o.response_ids), kv) == pytest.approx(
            o.kept_ratio, abs=1e-12)
        # slots held: the native engine's peak (tokens after the prefill's compression, then
        # after each decode step's write) is the rule's largest cache
        cache = CacheLength(BudgetTable(kv), len(p))
        peak = max([cache.at(len(p)).length] +
                   [cache.at(t).length + 1 for t in range(len(p), total - 1)])
        assert o.peak_kv_bytes == peak * eng.kv_bytes_per_token()


@pytest.mark.parametrize("kv, prompt_len", [
    (KVConfig(policy="snapkv", budget=10, compress_every=4), 3),
    (KVConfig(policy="snapkv", budget=10, compress_every=4), 12),
    (KVConfig(policy="rkv", budgets=[12, 8, 10], bin_tokens=16, compress_every=3), 5),
])
def test_next_compaction_is_the_next_position_that_compacts(kv, prompt_len):
    """The lookahead the runner uses to record queries only before a compaction equals the
    positions the rule compacts at, asked from every position (prefill ones included), and does
    not move the rule (asking it again, or going on, gives the same answers)."""
    total = 60
    want = [t for t, _ in compactions(kv, prompt_len, total + 40)]
    want = [a + 1 for a in want]                      # compactions() lists t - 1
    cache = CacheLength(BudgetTable(kv), prompt_len)
    for t in range(total):
        nxt = cache.next_compaction(t)
        assert nxt == cache.next_compaction(t)
        assert nxt == min(u for u in want if u > t), t
    assert CacheLength(BudgetTable(KVConfig(policy="dense")), 4).next_compaction(7) is None


def _probed(layout: str, nb: int = 5, bs: int = 4, heads: int = 2, d: int = 3):
    """A CellMap probed on a synthetic backend: ``combined`` [blocks, B, 2, H, D] (keys and
    values of a block side by side), ``split`` [2, blocks, B, H, D] (FlashAttention's),
    ``strided`` [B, blocks, 2, H, D] (a block's cells spread over the whole cache)."""
    from actors.vllm.evict.layout import CellMap

    shape = {"combined": (nb, bs, 2, heads, d), "split": (2, nb, bs, heads, d),
             "strided": (bs, nb, 2, heads, d)}[layout]

    def cells(cache, slots):
        blk, o = slots // bs, slots % bs
        if layout == "combined":
            return cache[blk, o, 0], cache[blk, o, 1]
        if layout == "split":
            return cache[0, blk, o], cache[1, blk, o]
        return cache[o, blk, 0], cache[o, blk, 1]

    def write(key, value, cache, slots):
        blk, o = slots // bs, slots % bs
        if layout == "combined":
            cache[blk, o, 0], cache[blk, o, 1] = key, value
        elif layout == "split":
            cache[0, blk, o], cache[1, blk, o] = key, value
        else:
            cache[o, blk, 0], cache[o, blk, 1] = key, value

    cache = torch.zeros(shape)
    return CellMap.probe(write, cache, nb, bs, heads, d), cache, write, cells


@pytest.mark.parametrize("layout", ["combined", "split"])
def test_block_moves_on_other_layouts(layout):
    """Keys and values in one span per block, or in separate spans (FlashAttention's layout):
    read / unpack / pack / write move exactly the cells of the blocks written, nothing else."""
    nb, bs, heads, d = 5, 4, 2, 3
    cmap, cache, write, cells = _probed(layout, nb, bs, heads, d)
    assert len(cmap.spans) == (1 if layout == "combined" else 2)
    slots = torch.arange(nb * bs)
    key, val = torch.randn(nb * bs, heads, d), torch.randn(nb * bs, heads, d)
    write(key, val, cache, slots)
    blocks = torch.tensor([[3, 1], [0, 4]])
    chunks = cmap.read(cache, blocks)
    k = cmap.unpack(chunks, "k")
    want = torch.stack([key[torch.cat([torch.arange(b * bs, b * bs + bs) for b in row])]
                        for row in blocks.tolist()]).transpose(1, 2)
    assert torch.equal(k, want)
    before = cache.clone()
    new_k, new_v = torch.randn(2, heads, bs, d), torch.randn(2, heads, bs, d)
    cmap.pack(chunks, "k", new_k)
    cmap.pack(chunks, "v", new_v)
    cmap.write(cache, blocks[:, :1], chunks)
    for r in range(2):
        got_k, got_v = cells(cache, blocks[r, 0] * bs + torch.arange(bs))
        assert torch.equal(got_k, new_k[r].transpose(0, 1))
        assert torch.equal(got_v, new_v[r].transpose(0, 1))
    other = torch.tensor([b for b in range(nb) if b not in (3, 0)])
    for b in other.tolist():
        assert [torch.equal(x, y) for x, y in zip(cells(cache, b * bs + torch.arange(bs)),
                                                  cells(before, b * bs + torch.arange(bs)))] \
            == [True, True], b


def test_block_moves_refuse_a_layout_whose_blocks_interleave():
    with pytest.raises(ValueError, match="span"):
        _probed("strided")
