"""RolloutActor: buffer rows, evaluation, versioned weights, configs."""
from __future__ import annotations

import threading

import pytest
import torch

from actors.config import KVConfig, RolloutConfig, ScorerConfig
from actors.rollout import make_engine
from actors.rollout import RolloutActor
from common.errors import ConfigError
from common.testmodels import build_model
from tasks.base import Problem
from conftest import ContainsAnswer

torch.set_num_threads(1)
ROW_KEYS = {"sample_id", "group_id", "prompt_idx", "prompt_ids", "response_ids", "sampler_logprobs",
            "reward", "policy_version", "kv_policy", "kv_budget", "kept_ratio", "prompt_len",
            "response_len", "finish_reason", "gen_time_s", "logprob_mode", "peak_kv_bytes",
            "reward_fault", "kv_bin_budgets", "kv_agreement"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_model(tmp_path_factory.mktemp("m"), "tiny", seed=0))


def make_actor(model_dir, **kw):
    kv = kw.pop("kv", KVConfig())
    cfg = RolloutConfig(model_path=model_dir, samples_per_prompt=3, max_new_tokens=8, kv=kv, **kw)
    actor = RolloutActor(cfg, task_cfg=None, model_path=model_dir, actor_id=1)
    actor._task = ContainsAnswer()
    return actor


PROBLEMS = [Problem(0, "1+2=", "3"), Problem(7, "hello", "o"), Problem(9, "ab", "zz")]


def test_rollout_rows(model_dir):
    actor = make_actor(model_dir, kv=KVConfig(policy="streaming", budget=6, compress_every=2,
                                              sink_tokens=2))
    rows = actor.rollout(PROBLEMS, version=4)
    assert len(rows) == 9 and all(set(r) == ROW_KEYS for r in rows)
    assert all(r["peak_kv_bytes"] > 0 for r in rows)
    assert len({r["sample_id"] for r in rows}) == 9 and len({r["group_id"] for r in rows}) == 3
    for j, r in enumerate(rows):
        assert r["prompt_idx"] == PROBLEMS[j // 3].idx
        assert r["response_len"] == len(r["response_ids"]) == len(r["sampler_logprobs"])
        assert r["prompt_len"] == len(r["prompt_ids"]) > 0
        assert r["policy_version"] == 4 and r["kv_policy"] == "streaming" and r["kv_budget"] == 6
        assert 0 < r["kept_ratio"] <= 1 and r["logprob_mode"] == "processed"
        assert r["finish_reason"] in ("stop", "length") and r["reward"] in (0.0, 1.0)
        assert all(lp <= 0 for lp in r["sampler_logprobs"])
    text = actor.tokenizer.decode(rows[0]["response_ids"], skip_special_tokens=True)
    assert rows[0]["reward"] == (1.0 if "3" in text else 0.0)
    assert rows[0]["kept_ratio"] < 1.0                 # prompt 4 + 8 new tokens > budget 6


def test_evaluate_and_dense_budget(model_dir):
    actor = make_actor(model_dir)
    res = actor.evaluate(PROBLEMS, greedy=True)
    assert 0.0 <= res["accuracy"] <= 1.0 and res["num_problems"] == 3
    assert res == {**res, "kept_ratio": 1.0}
    assert actor.rollout(PROBLEMS[:1], 0)[0]["kv_budget"] == 0


def test_dense_rows_hold_every_token_but_the_last_sampled(model_dir):
    """The reference of a run's rollout KV (``rollout/kv_vs_dense``): a dense cache holds each
    prompt and response token once, K and V in every layer, except the last token sampled."""
    import pyarrow as pa

    from launch.metrics import kv_vs_dense

    actor = make_actor(model_dir)
    cfg = actor.engine.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bpt = actor.kv_bytes_per_token()
    assert bpt == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # float32
    rows = actor.rollout(PROBLEMS, version=0)
    for r in rows:
        assert r["peak_kv_bytes"] == (r["prompt_len"] + r["response_len"] - 1) * bpt
    keys = ("peak_kv_bytes", "prompt_len", "response_len")
    ratio = kv_vs_dense(pa.table({k: [r[k] for r in rows] for k in keys}), bpt)
    tokens = sum(r["prompt_len"] + r["response_len"] for r in rows)
    assert ratio == pytest.approx((tokens - len(rows)) / tokens)


def test_weights_via_load_and_weight_sync(model_dir, tmp_path):
    from cluster.weight_sync import WeightSender, free_port
    from common.modeling import load_model

    actor = make_actor(model_dir)
    other = load_model(build_model(tmp_path / "o", "tiny", seed=5))
    target = NativeChecksum(other)
    actor.load_weights(list(other.named_parameters()), 3)
    assert actor.version == 3 and actor.state_checksum() == target


def test_weights_received_in_place_reach_generation(tmp_path):
    """MLP weights of 2 MiB travel alone and land straight in the staging copy, which the swap
    copies into the parameters (nothing bumps their ``_version``): generation afterwards uses
    exactly the new weights, not caches built from the old ones."""
    from cluster.weight_sync import WeightSender, free_port
    from common.modeling import load_model

    dims = dict(hidden_size=128, intermediate_size=4096, num_hidden_layers=1)
    base = str(build_model(tmp_path / "b", "tiny", seed=0, **dims))
    other = load_model(build_model(tmp_path / "o", "tiny", seed=5, **dims))
    target = NativeChecksum(other)
    actor = make_actor(base)
    actor.load_weights(list(other.named_parameters()), 3)
    expected = actor.rollout(PROBLEMS, version=3, batch=1)
    for shm in (True, False):  # the shared-memory ring, and gloo over TCP
        actor2 = make_actor(base)
        before = actor2.rollout(PROBLEMS, version=0, batch=1)  # builds the engine's weight caches
        port = free_port()
        spec = actor2.weight_spec()
        result = {}

        def learner():
            sender = WeightSender("127.0.0.1", port, 2, spec, same_host_shm=shm)
            sender.send(list(other.named_parameters()), 11)
            result["ok"] = True

        th = threading.Thread(target=learner)
        th.start()
        actor2.init_weight_sync("127.0.0.1", port, 1, 2)
        assert actor2.sync_weights() == 11
        th.join(timeout=60)
        assert result.get("ok") and actor2.state_checksum() == target
        # received straight into the parameters: generation must use them, not stale caches
        after = actor2.rollout(PROBLEMS, version=3, batch=1)
        assert [r["sampler_logprobs"] for r in after] == [r["sampler_logprobs"] for r in expected]
        assert [r["sampler_logprobs"] for r in before] != [r["sampler_logprobs"] for r in after]


def test_staged_weights_swap_in_between_rollouts_never_mid_generation(tmp_path):
    """Rollouts ahead: ``stage_weights`` receives beside a rollout in progress (its own thread, as
    in the actor's "weights" concurrency group) without touching the model; the next rollout swaps
    the staged copy in first, checks it against the staged checksum, and tags its rows with that
    version; they equal the rows of an actor that was handed those weights directly."""
    from cluster.weight_sync import WeightSender, free_port
    from common.modeling import load_model

    base = str(build_model(tmp_path / "b", "tiny", seed=0))
    other = load_model(build_model(tmp_path / "o", "tiny", seed=5))
    target = NativeChecksum(other)
    ref_old = make_actor(base).rollout(PROBLEMS, version=0, batch=1)
    ref_new_actor = make_actor(base)
    ref_new_actor.load_weights(list(other.named_parameters()), 11)
    ref_new = ref_new_actor.rollout(PROBLEMS, version=11, batch=2)

    actor = make_actor(base)
    old_sum = actor.state_checksum()
    port, spec = free_port(), actor.weight_spec()
    go, result = threading.Event(), {}

    def learner():
        sender = WeightSender("127.0.0.1", port, 2, spec)
        go.wait(60)
        sender.send(list(other.named_parameters()), 11)
        result["sent"] = True

    th = threading.Thread(target=learner)
    th.start()
    actor.init_weight_sync("127.0.0.1", port, 1, 2)

    generating, release, seen = threading.Event(), threading.Event(), []
    orig = actor.engine.generate

    def slow_generate(prompts, params):
        generating.set()
        assert release.wait(60)
        out = orig(prompts, params)
        seen.append(actor.state_checksum())  # the weights at the end of this generation
        return out

    actor.engine.generate = slow_generate
    rolling = {}
    gen = threading.Thread(target=lambda: rolling.update(rows=actor.rollout(PROBLEMS, None, 1)))
    gen.start()
    assert generating.wait(60)  # mid-generation: a broadcast arrives and is staged
    go.set()
    staged = actor.stage_weights()
    th.join(60)
    assert result.get("sent") and staged == {"version": 11, "checksum": target}
    assert actor.state_checksum() == old_sum and actor.version == 0  # staged, not swapped
    release.set()
    gen.join(60)
    rows = rolling["rows"]
    assert seen == [old_sum]  # the whole generation ran on the old weights...
    assert all(r["policy_version"] == 0 for r in rows)  # ...and its rows say so
    assert [r["sampler_logprobs"] for r in rows] == [r["sampler_logprobs"] for r in ref_old]

    after = actor.rollout(PROBLEMS, None, 2)  # swaps first: version 11's weights, tagged 11
    assert seen[-1] == target and actor.version == 11 and actor.swaps == [(11, target)]
    assert all(r["policy_version"] == 11 and r["group_id"].startswith("v11-") for r in after)
    assert [r["sampler_logprobs"] for r in after] == [r["sampler_logprobs"] for r in ref_new]
    actor.rollout(PROBLEMS, None, 3)  # nothing staged: no second swap
    assert actor.swaps == [(11, target)]


def test_swap_refuses_staged_weights_that_differ_from_their_checksum(model_dir):
    from actors.weights import StagedWeights

    actor = make_actor(model_dir)
    staging = StagedWeights(None, actor._weight_template())
    staging._staged = {n: p.detach().clone() for n, p in actor.engine.model.named_parameters()}
    staging.version, staging.checksum = 5, actor.state_checksum() + 1.0
    actor._receiver = staging
    with pytest.raises(RuntimeError, match="checksum"):
        actor.evaluate(PROBLEMS[:1])


def _stage_from_thread(actor, named, version: int) -> dict:
    """Join a one-receiver group with a sender thread standing in for the learner, send ``named``
    tagged ``version``, and return what ``stage_weights`` reports."""
    from cluster.weight_sync import WeightSender, free_port

    port, spec, sent = free_port(), actor.weight_spec(), {}

    def learner():
        sender = WeightSender("127.0.0.1", port, 2, spec)
        sender.send(named, version)
        sent["ok"] = True

    th = threading.Thread(target=learner)
    th.start()
    actor.init_weight_sync("127.0.0.1", port, 1, 2)
    staged = actor.stage_weights()
    th.join(60)
    assert sent.get("ok")
    return staged


def test_a_call_tagged_with_a_version_runs_on_it_even_with_a_newer_one_staged(tmp_path):
    """run.rollouts_ahead=1 in async mode: the driver tags a batch with version v when it launches
    it; a broadcast of v+1 may be staged before the actor starts that batch. The batch must still
    run on v (its rows say v); the next batch tagged v+1 swaps v+1 in."""
    from common.modeling import load_model

    base = str(build_model(tmp_path / "b", "tiny", seed=0))
    other = load_model(build_model(tmp_path / "o", "tiny", seed=5))
    ref_old = make_actor(base).rollout(PROBLEMS, version=0, batch=1)
    actor = make_actor(base)
    old_sum = actor.state_checksum()
    staged = _stage_from_thread(actor, list(other.named_parameters()), 1)
    assert staged == {"version": 1, "checksum": NativeChecksum(other)}
    rows = actor.rollout(PROBLEMS, version=0, batch=1)     # launched before the broadcast
    assert actor.state_checksum() == old_sum and actor.swaps == []
    assert [r["sampler_logprobs"] for r in rows] == [r["sampler_logprobs"] for r in ref_old]
    rows = actor.rollout(PROBLEMS, version=1, batch=2)     # the next batch: swapped first
    assert actor.version == 1 and actor.swaps == [(1, NativeChecksum(other))]
    assert all(r["policy_version"] == 1 for r in rows)


def NativeChecksum(model):
    from common.modeling import checksum

    return checksum(model.named_parameters())


def test_config_validation_names_keys():
    with pytest.raises(ConfigError, match="rollout.kv.budget"):
        RolloutConfig(kv=KVConfig(budget=0)).validate("rollout")
    with pytest.raises(ConfigError, match="rollout.temperature"):
        RolloutConfig(temperature=0.0).validate("rollout")
    with pytest.raises(ConfigError, match="rollout.kv.sink_tokens"):
        KVConfig(policy="streaming", budget=4, sink_tokens=4).validate("rollout.kv")
    with pytest.raises(ConfigError, match="rollout.kv.policy"):
        KVConfig(policy="bogus")
    with pytest.raises(ConfigError, match="scorer.micro_batch"):
        ScorerConfig(micro_batch=0).validate("scorer")
    RolloutConfig().validate("rollout")
    ScorerConfig().validate("scorer")


def test_omegaconf_structured_and_vllm_without_vllm(model_dir):
    from omegaconf import OmegaConf

    base = OmegaConf.structured(RolloutConfig)
    cfg = OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.create(
        {"engine": "vllm", "kv": {"policy": "rkv", "budget": 64}})))
    assert cfg.kv.policy.value == "rkv" and cfg.kv.budget == 64
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match="rollout.engine"):
            make_engine(cfg, model_dir)
    with pytest.raises(Exception):
        OmegaConf.merge(base, OmegaConf.create({"kv": {"policy": "bogus"}}))


def test_evaluate_decodes_densely_unless_asked(model_dir):
    """Held-out accuracy measures the model: a sparse actor evaluates with a dense cache over the
    same (shared) weights by default, and with its own KV policy when dense=False."""
    sparse_kv = KVConfig(policy="streaming", budget=3, compress_every=1, sink_tokens=1)
    sparse = make_actor(model_dir, kv=sparse_kv)
    dense = make_actor(model_dir)
    as_dense = sparse.evaluate(PROBLEMS, greedy=True)
    assert as_dense == {**dense.evaluate(PROBLEMS, greedy=True), "gen_time_s": as_dense["gen_time_s"]}
    assert as_dense["kept_ratio"] == 1.0
    assert sparse.evaluate(PROBLEMS, greedy=True, dense=False)["kept_ratio"] < 1.0
    # The dense evaluator shares the model, so weight updates reach it too.
    assert sparse._dense_engine().model is sparse.engine.model


def test_numbered_batches_reproduce_across_fresh_actors(model_dir):
    """A resumed run has fresh actors: the driver's batch number alone fixes samples and ids."""
    a, b = make_actor(model_dir, temperature=1.0), make_actor(model_dir, temperature=1.0)
    a.evaluate(PROBLEMS[:1], greedy=False)  # earlier calls on one actor must not shift its seeds
    ra, rb = a.rollout(PROBLEMS, version=2, batch=5), b.rollout(PROBLEMS, version=2, batch=5)
    key = lambda rows: [(r["sample_id"], r["response_ids"], r["sampler_logprobs"]) for r in rows]
    assert key(ra) == key(rb)
    assert all("-b5-" in r["sample_id"] for r in ra)
    other = b.rollout(PROBLEMS, version=2, batch=6)
    assert [r["response_ids"] for r in other] != [r["response_ids"] for r in ra]
