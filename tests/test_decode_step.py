"""The native decode step: no host sync, fixed shapes (torch.compile without graph breaks or
recompiles), compression ops independent of the batch (issue 27's CPU bars)."""
from __future__ import annotations

import pytest
import torch

from actors.config import KVConfig
from actors.engine import SamplingParams
from actors.native import NativeEngine, forced
from actors.native.step import StepRunner, bucket
from bench import decode_profile
from common.modeling import load_model
from common.testmodels import build_model

torch.set_num_threads(1)
POLICIES = ["dense", "streaming", "h2o", "snapkv", "rkv"]
# the per-row budget (rollout.kv.keep_mass), named as decode_profile names its rows
ADAPTIVE = [p for p in decode_profile.POLICIES if p.endswith(decode_profile.ADAPTIVE)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_model(tmp_path_factory.mktemp("m"), "tiny", seed=3))


def kv(policy):
    if policy in ADAPTIVE:
        return KVConfig(policy=policy.removesuffix(decode_profile.ADAPTIVE), budget=12, compress_every=5,
                        obs_window=4, keep_mass=0.9, min_budget=6)
    return KVConfig(policy=policy, budget=12, compress_every=5, sink_tokens=2, obs_window=4,
                    pool_kernel=3)


def test_buckets():
    assert [bucket(n) for n in (1, 3, 5, 17, 64, 65, 200, 257, 300)] == \
        [1, 4, 8, 24, 64, 96, 256, 384, 384]


@pytest.mark.parametrize("policy", POLICIES + ADAPTIVE)
def test_compiled_step_runs_a_generation_without_graph_break_or_recompile(model, policy):
    """fullgraph=True raises on any graph break; error_on_recompile on any re-trace. The rows
    compress four times and every row stays to the end (one bucket), so one graph serves all."""
    import torch._dynamo

    prompts = [list(range(5, 13)), [7, 8, 9, 10], list(range(20, 30))]
    params = SamplingParams(max_new_tokens=30, temperature=0)
    want = NativeEngine(model, kv(policy), step="eager", trace=True).generate(prompts, params)
    torch._dynamo.reset()
    eng = NativeEngine(model, kv(policy), trace=True)
    eng.stepper = StepRunner("compile", backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = eng.generate(prompts, params)
    assert eng._kept_pool[1].rows == len(prompts)                # no rows beyond the batch
    for w, g in zip(want, got):
        assert g.response_ids == w.response_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs),
                                   atol=1e-5, rtol=0)
        if policy != "dense":
            assert len(g.trace) == len(w.trace) >= 4


@pytest.fixture(scope="module")
def profile_rows(model):
    class Args:
        prompt_len, gen_len, budget, every = 8, 48, 16, 8
        keep_mass, min_budget = 0.9, 0
    return decode_profile.run(model, POLICIES + ADAPTIVE, [16, 64], Args)


def test_a_decode_step_reads_the_device_at_most_once(profile_rows):
    for r in profile_rows:
        assert r["steps"] > 30
        assert r["syncs_per_step"] <= 1, r             # the sampled tokens, for stop handling
        # a fixed budget compresses without a read; the adaptive one reads the row budgets once
        assert r["syncs_per_compression"] == (r["policy"] in ADAPTIVE), r
        if r["policy"] != "dense":
            assert r["compressions"] >= 3


def test_without_stops_a_decode_step_never_reads_the_device(model):
    class Args:
        prompt_len, gen_len, budget, every = 8, 40, 16, 8
    eng = NativeEngine(model, kv("rkv"), batch_size=8, step="eager")
    prompts = torch.randint(3, 200, (8, 8), generator=torch.Generator().manual_seed(0)).tolist()
    got = decode_profile.profile(eng, prompts, SamplingParams(max_new_tokens=40, seed=0))
    assert got["steps"] > 30 and got["syncs_per_step"] == 0
    assert "_compress" not in eng.__dict__                     # the profile leaves no patch


def test_compression_ops_do_not_grow_with_the_batch(profile_rows):
    by = {(r["policy"], r["batch"]): r for r in profile_rows}
    for policy in POLICIES[1:] + ADAPTIVE:
        small, large = by[(policy, 16)], by[(policy, 64)]
        assert small["ops_per_compression"] > 0
        assert large["ops_per_compression"] <= 1.1 * small["ops_per_compression"]
    assert all("PASS" in line for line in decode_profile.bars(profile_rows))


def test_step_modes_resolve_by_device():
    assert StepRunner().resolve(torch.device("cpu")) == "eager"
    assert StepRunner().resolve(torch.device("cuda")) == "graphs"
    with pytest.raises(ValueError, match="'graphs' needs a CUDA device"):
        StepRunner("graphs").resolve(torch.device("cpu"))
    with pytest.raises(ValueError, match="step mode must be one of"):
        StepRunner("fast")


def test_captured_graphs_belong_to_one_pool_table_and_weights(model):
    """The CUDA graphs are kept only for the pool, rope table and weights they were captured on,
    held weakly: a pool allocated after the old one is freed (which may get its ``id``) is a new
    owner, and so is a weight tensor at another address."""
    import weakref

    from actors.native.kvcache import KVPool

    eng = NativeEngine(model, kv("dense"), batch_size=2, step="eager")
    runner, dec, rope = StepRunner("graphs"), eng.dec, eng._rope_table(8)
    make = lambda: KVPool(dec.n_layers, 2, dec.n_kv, dec.n_heads, dec.head_dim, 16, dec.dtype)  # noqa: E731
    pool = make()
    assert not runner._captured_for(dec, pool, rope)                # nothing captured yet
    runner.owner = (weakref.ref(pool), weakref.ref(rope), runner._weight_ptrs(dec))
    assert runner._captured_for(dec, pool, rope)
    assert not runner._captured_for(dec, make(), rope)              # another pool, same shape
    del pool
    assert not runner._captured_for(dec, make(), rope)              # the old one freed
    pool = make()
    runner.owner = (weakref.ref(pool), weakref.ref(rope), (0, 0))   # weights moved since
    assert not runner._captured_for(dec, pool, rope)


@pytest.mark.parametrize("batch_size", [8, 2])
def test_a_stop_read_one_step_late_is_rolled_back_exactly(model, batch_size):
    """The sampled tokens are read one step late (overlapped with the next step), so a row that
    stopped decodes one extra step: its output must be exactly the prefix up to the stop token of
    the same generation without stop tokens (greedy), with the same kept sets (StreamingLLM: no
    score ties), and no trace event past the stop."""
    prompts = [list(range(5, 13)), [7, 8, 9, 10], list(range(20, 30)), [3, 4, 5], [9, 9, 9]]
    cfg = KVConfig(policy="streaming", budget=8, compress_every=3, sink_tokens=2)
    free = NativeEngine(model, cfg, batch_size=batch_size, trace=True).generate(
        prompts, SamplingParams(max_new_tokens=30, temperature=0))
    stop = free[0].response_ids[9]
    got = NativeEngine(model, cfg, batch_size=batch_size, trace=True).generate(
        prompts, SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=(stop,)))
    assert sum(o.finish_reason == "stop" for o in got) >= 1
    for f, g in zip(free, got):
        n = f.response_ids.index(stop) + 1 if stop in f.response_ids else 30
        assert g.response_ids == f.response_ids[:n]
        assert g.finish_reason == ("stop" if stop in f.response_ids else "length")
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(f.logprobs[:n]),
                                   atol=1e-5, rtol=0)
        total = len(g.prompt_ids) + n
        want = [(a, k) for a, k in f.trace if a < total - 2]
        assert [a for a, _ in g.trace] == [a for a, _ in want]
        assert all(torch.equal(k1, k2) for (_, k1), (_, k2) in zip(g.trace, want))
        # kept ratio and peak follow from lengths alone (StreamingLLM): as if the row stopped on
        # time, i.e. equal to a lone run of exactly n tokens
        alone = NativeEngine(model, cfg, batch_size=1).generate(
            [g.prompt_ids], SamplingParams(max_new_tokens=n, temperature=0))[0]
        assert g.kept_ratio == pytest.approx(alone.kept_ratio, abs=1e-12)
        assert g.peak_kv_bytes == alone.peak_kv_bytes


def test_compiled_step_pads_with_free_rows_one_graph_per_bucket(model):
    """Rows of different lengths (the decode loop forced: 24, 24, 24, 10, 10, 10 tokens) leave
    the batch: the live rows go from 6 (the pool's rows, bucket 8 capped) to 3, stepped as bucket
    4 with a free row of the pool as padding; each bucket is traced once, and the padded steps
    give the eager step's log-probs."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    prompts = [list(range(5, 13)), [7, 8, 9, 10], list(range(20, 30)), [3, 4, 5], [9, 9, 9],
               [11, 12]]
    params = SamplingParams(max_new_tokens=24, temperature=0)
    free = NativeEngine(model, kv("snapkv"), step="eager").generate(prompts, params)
    responses = [o.response_ids[:24 if i < 3 else 10] for i, o in enumerate(free)]
    want, _ = forced.stepwise(NativeEngine(model, kv("snapkv"), step="eager"), prompts,
                              responses, params)
    torch._dynamo.reset()
    counters.clear()
    eng = NativeEngine(model, kv("snapkv"))
    eng.stepper = StepRunner("compile", backend="eager")
    got, _ = forced.stepwise(eng, prompts, responses, params)
    assert counters["stats"]["unique_graphs"] == 2                 # buckets 6 (8 capped) and 4
    for w, g in zip(want, got):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_decode_cuda_bench_runs_on_the_cpu(tmp_path):
    """bench/decode_cuda.py's smoke mode: every (policy, mode) row with its timings and ops."""
    import json

    from bench import decode_cuda

    out = tmp_path / "dc.json"
    assert decode_cuda.main(["--device", "cpu", "--batch", "2", "--prompt-len", "4",
                             "--gen-len", "12", "--trace-len", "4", "--budget", "8", "--every",
                             "4", "--modes", "eager", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["policy"], r["mode"]) for r in rows] == [("dense", "eager"), ("rkv", "eager")]
    assert all(r["ms_per_step"] > 0 and r["top_host_ops"] for r in rows)
