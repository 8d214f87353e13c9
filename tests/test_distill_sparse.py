"""DistillSparse (issue 14): the sparse sampler's LoRA adapter.

The adapter changes only the sampler's distribution; a zero LoRA B is the base policy; the
learner's recomputation under the recorded kept sets reproduces the sampler's log-probs; the adapter
learns only from its loss and the base only from the main loss; it travels with the broadcast,
survives checkpoints and sits beside the HF export; config errors name their key."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from actors.config import DistillSparseConfig, KVConfig, RolloutConfig
from actors.rollout import RolloutActor
from common import lora
from common.errors import ConfigError
from common.modeling import checksum, load_model, token_logprobs
from correction import CorrectionConfig
from learner.config import LearnerConfig
from tasks.base import Problem
from conftest import ContainsAnswer

torch.set_num_threads(1)
os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                      os.path.join(os.path.dirname(__file__), "..", ".cache", "torch_extensions"))
_PORT = 29731  # DeepSpeed's default group: one per process, shared with test_learner_single
KV = dict(policy="rkv", budget=10, compress_every=4)
PROBLEMS = [Problem(0, "1+2=", "3"), Problem(7, "hello world", "o"), Problem(9, "ab", "zz")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from common.testmodels import build_model

    return str(build_model(tmp_path_factory.mktemp("m"), "gqa", seed=0))


def make_actor(model_dir, enabled=True, **kw):
    cfg = RolloutConfig(model_path=model_dir, samples_per_prompt=4, max_new_tokens=24,
                        kv=KVConfig(**KV),
                        distill_sparse=DistillSparseConfig(enabled=enabled, **kw))
    actor = RolloutActor(cfg, task_cfg=None, model_path=model_dir)
    actor._task = ContainsAnswer()
    return actor


def random_adapter(actor, seed=0, scale=0.5) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(n, scale * torch.randn(t.shape, generator=g))
            for n, t in actor.adapter.tensors.items()]


def scored_batch(actor, model_dir, batch=0):
    """One rollout batch as the learner gets it (bench/distill.py's, which schedule.py uses)."""
    from bench.distill import scored_batch as scored

    return scored(actor, load_model(model_dir), PROBLEMS, batch)


# ---- config -----------------------------------------------------------------------------------
def test_divergence_is_an_enum_named_in_errors():
    with pytest.raises(ConfigError) as e:
        DistillSparseConfig(divergence="l2")
    assert e.value.key == "rollout.distill_sparse.divergence"
    assert DistillSparseConfig(divergence="tv").divergence.value == "tv"


@pytest.mark.parametrize("kw,key", [
    ({"rank": 0}, "rollout.distill_sparse.rank"), ({"alpha": 0.0}, "rollout.distill_sparse.alpha"),
    ({"lr": 0.0}, "rollout.distill_sparse.lr"),
    ({"kl_coef": -1.0}, "rollout.distill_sparse.kl_coef"),
    ({"target_modules": []}, "rollout.distill_sparse.target_modules"),
    ({"target_modules": ["q_proj", "q_proj"]}, "rollout.distill_sparse.target_modules"),
    ({"target_modules": ["lm_head"]}, "rollout.distill_sparse.target_modules")])
def test_config_errors_name_the_key(kw, key):
    with pytest.raises(ConfigError) as e:
        RolloutConfig(kv=KVConfig(**KV), distill_sparse=DistillSparseConfig(**kw)).validate()
    assert e.value.key == key


def test_config_refuses_a_dense_sampler_and_vllms_window_and_takes_zero3():
    from launch.config import load_config

    with pytest.raises(ConfigError) as e:  # nothing sparse to adapt
        RolloutConfig(distill_sparse=DistillSparseConfig(enabled=True)).validate()
    assert e.value.key == "rollout.distill_sparse.enabled"
    with pytest.raises(ConfigError) as e:   # vLLM's window records no kept sets
        RolloutConfig(engine="vllm", kv=KVConfig(policy="streaming", budget=64),
                      distill_sparse=DistillSparseConfig(enabled=True)).validate()
    assert e.value.key == "rollout.distill_sparse.enabled"
    with pytest.raises(ConfigError) as e:   # past vLLM's largest LoRA rank
        RolloutConfig(engine="vllm", kv=KVConfig(**KV),
                      distill_sparse=DistillSparseConfig(enabled=True, rank=600)).validate()
    assert e.value.key == "rollout.distill_sparse.rank"
    RolloutConfig(engine="vllm", kv=KVConfig(**KV),
                  distill_sparse=DistillSparseConfig(enabled=True)).validate()
    on = ["rollout.kv.policy=rkv", "rollout.distill_sparse.enabled=true"]
    assert load_config(on).rollout.distill_sparse.kl_coef == 0.001   # Sparrow's lambda
    assert load_config(on + ["learner.zero_stage=3"]).learner.zero_stage == 3  # gathers per step


# ---- kept sets --------------------------------------------------------------------------------
def test_learner_recomputes_the_samplers_logprobs_under_its_kept_sets(model_dir):
    """Faithfulness: base + zero adapter under each row's kv_evictions gives the sampler's own
    log-probs (float32), where the dense forward is far off; a random adapter moves them."""
    from learner.distill import SparseAdapter

    actor = make_actor(model_dir)
    t = scored_batch(actor, model_dir)
    base = load_model(model_dir)
    adapter = SparseAdapter(DistillSparseConfig(enabled=True), model_dir,
                            dict(base.named_parameters()), torch.float32)
    rows, tt = torch.arange(t["input_ids"].shape[0]), t["input_ids"].shape[1]
    resp = t["response_mask"].bool()
    assert resp.sum() > 50 and (t["kv_evictions"] >= 0).any()       # compressions happened
    with torch.no_grad():
        sparse = adapter.sparse_logprobs(t, rows, tt, 1.0)
    assert (sparse - t["sampler_logprobs"])[resp].abs().max() < 1e-4
    assert (t["old_logprobs"] - t["sampler_logprobs"])[resp].abs().max() > 1e-2
    with torch.no_grad():
        for p in adapter.params.values():
            p.normal_(0, 0.3)
        moved = adapter.sparse_logprobs(t, rows, tt, 1.0)
    assert (moved - sparse)[resp].abs().max() > 1e-3


def test_tv_term_is_one_minus_the_probes_alpha(model_dir):
    """divergence=tv: with a zero adapter the term is sum(1 - alpha) over the response tokens,
    alpha the exact agreement the schedule's probes measure by replaying each sample through the
    sparse engine and a dense cache (actors.probes.agreement)."""
    from actors.engine import SamplingParams
    from actors.native import NativeEngine
    from actors.probes import agreement
    from learner.distill import SparseAdapter

    t = scored_batch(make_actor(model_dir), model_dir)
    base = load_model(model_dir)
    adapter = SparseAdapter(DistillSparseConfig(enabled=True, divergence="tv"), model_dir,
                            dict(base.named_parameters()), torch.float32)
    n, tt = t["input_ids"].shape
    with torch.no_grad():
        tv = float(adapter.tv_sum(t, torch.arange(n), tt, 1.0))
    resp, real = t["response_mask"].bool(), t["attention_mask"].bool()
    prompts = [t["input_ids"][i][real[i] & ~resp[i]].tolist() for i in range(n)]
    responses = [t["input_ids"][i][resp[i]].tolist() for i in range(n)]
    alphas = agreement(NativeEngine(base, KVConfig(**KV), 16), prompts, responses,
                       SamplingParams(max_new_tokens=24, temperature=1.0), 16)
    expected = sum(1.0 - a for row in alphas for a in row)
    assert expected > 0.5                                   # evictions changed distributions
    assert tv == pytest.approx(expected, rel=1e-4)


def test_tv_divergence_moves_the_sampler_toward_dense(model_dir):
    """Adapter steps on the exact TV term alone (no advantages: a pure distillation) lower the
    batch's mean TV to the dense base, step after step; the k3 term is off."""
    from correction import CorrectionConfig
    from learner.distill import SparseAdapter

    t = scored_batch(make_actor(model_dir), model_dir)
    t["advantages"] = torch.zeros_like(t["advantages"])
    base = load_model(model_dir)
    adapter = SparseAdapter(DistillSparseConfig(enabled=True, divergence="tv", kl_coef=1.0,
                                                lr=3e-3), model_dir,
                            dict(base.named_parameters()), torch.float32)
    # each step reports the TV its forward measured, before its own update
    tvs = [adapter.train_step(dict(t), CorrectionConfig(), 1.0, 8)["distill/tv_dense"]
           for _ in range(8)]
    assert tvs[-1] < 0.75 * tvs[0], tvs
    assert all(b < a for a, b in zip(tvs, tvs[1:])), tvs


def test_evictions_column_round_trip_and_length_check():
    from buffer.schema import rows_to_batch
    from buffer.tensors import to_tensors

    row = {"group_id": "g", "prompt_idx": 0, "prompt_ids": [1, 2], "response_ids": [3, 4, 5],
           "sampler_logprobs": [-1.0] * 3, "reward": 1.0, "policy_version": 0}
    ev = list(range(-1, 9)) + list(range(10))   # 4 (layer, head) rows x 5 positions
    short = {**row, "prompt_ids": [1], "sampler_logprobs": [-1.0] * 3, "kv_evictions": ev[:16]}
    t = to_tensors(rows_to_batch([{**row, "kv_evictions": ev}, short]), pad_id=0)
    assert t["kv_evictions"].shape == (2, 4, 5)
    assert t["kv_evictions"][0].reshape(-1).tolist() == ev
    assert t["kv_evictions"][1, :, :4].reshape(-1).tolist() == ev[:16]
    assert (t["kv_evictions"][1, :, 4] == -1).all()                   # padding: never evicted
    with pytest.raises(ValueError, match="kv_evictions"):
        rows_to_batch([{**row, "kv_evictions": ev[:7]}])


# ---- the rollout actor ------------------------------------------------------------------------
def test_the_adapter_changes_only_the_samplers_distribution(model_dir):
    """Zero B: identical rollouts to an actor without adapter (step 0). A trained adapter:
    different sampler log-probs and samples, while dense evaluation, the rollout's dense
    log-probs and the base weights stay those of the base model."""
    plain, dist = make_actor(model_dir, enabled=False), make_actor(model_dir)
    a, b = plain.rollout(PROBLEMS, 0, batch=3), dist.rollout(PROBLEMS, 0, batch=3)
    for x, y in zip(a, b):
        assert x["response_ids"] == y["response_ids"]
        assert x["sampler_logprobs"] == pytest.approx(y["sampler_logprobs"], abs=1e-6)
        assert "kv_evictions" in y and "kv_evictions" not in x
    base_sum = plain.state_checksum()
    dist.load_weights(random_adapter(dist), 1)
    c = dist.rollout(PROBLEMS, 1, batch=3)
    same = [x["response_ids"] == y["response_ids"] for x, y in zip(a, c)]
    first = [abs(x["sampler_logprobs"][0] - y["sampler_logprobs"][0]) for x, y in zip(a, c)]
    assert not all(same) and max(first) > 1e-3
    assert checksum(dist.engine.model.named_parameters()) == base_sum      # base untouched
    assert _same_eval(plain, dist)                                        # dense decoding
    dense_a, dense_c = plain._dense_sampler_logprobs, dist._dense_sampler_logprobs
    outs = dist._generate(PROBLEMS, 2, greedy=False, batch=5)[0]
    assert torch.allclose(torch.tensor(sum(dense_a(outs), [])),
                          torch.tensor(sum(dense_c(outs), [])))


def _same_eval(plain, dist) -> bool:
    ea, eb = plain.evaluate(PROBLEMS), dist.evaluate(PROBLEMS)
    return {k: v for k, v in ea.items() if k != "gen_time_s"} == \
        {k: v for k, v in eb.items() if k != "gen_time_s"}


# ---- the learner ------------------------------------------------------------------------------
def _learner(model_dir, distill: bool, **kw):
    from learner.learner import Learner

    cfg = LearnerConfig(lr=1e-3, micro_batch_size=5, **kw)
    d = DistillSparseConfig(enabled=distill, lr=1e-2)
    return Learner(cfg, CorrectionConfig(), model_dir, master_port=_PORT, distill=d)


def test_adapter_and_base_learn_from_their_own_loss_only(model_dir):
    """The base takes exactly the step it takes without DistillSparse (no gradient from the
    adapter's loss); the adapter moves, only from its loss (its parameters are not the engine's;
    the base parameters of its model are the engine's, frozen, and get no gradient)."""
    actor = make_actor(model_dir)
    t = scored_batch(actor, model_dir)
    plain, dist = _learner(model_dir, False), _learner(model_dir, True)
    engine_ids = {id(p) for g in dist.optimizer.param_groups for p in g["params"]}
    assert not engine_ids & {id(p) for p in dist.distill.params.values()}
    frozen = [p for p in dist.distill.model.parameters() if not p.requires_grad]
    assert all(any(p.data_ptr() == q.data_ptr() for q in dist._params.values()) for p in frozen)
    before = {n: p.detach().clone() for n, p in dist.distill.params.items()}
    m0, m1 = plain.train_step(dict(t), 1.0), dist.train_step(dict(t), 1.0)
    for (n, x), (_, y) in zip(plain.named_weights(), dist.named_weights()):
        assert torch.equal(x, y), n
    assert m0["loss"] == m1["loss"]
    moved = {n for n, p in dist.distill.params.items() if not torch.equal(p, before[n])}
    # LoRA from B = 0: the first step's gradient reaches B only (dL/dA = B^T ...), the next A too
    assert moved == {n for n in before if n.endswith("lora_B")}
    assert m1["distill/optimizer_steps"] == 1 and m1["distill/grad_norm"] > 0
    assert 0.99 < m1["distill/ratio_mean"] < 1.01 and m1["distill/kl_dense"] > 0
    assert all(p.grad is None for p in frozen)
    dist.train_step(dict(t), 1.0)
    assert all(not torch.equal(p, before[n]) for n, p in dist.distill.params.items())


def test_broadcast_carries_the_adapter_to_rollout_and_scorer(model_dir, tmp_path):
    """Round trip: the learner's adapter reaches the rollout actor (merged into its sampler) and
    the scorer (held, unused); every checksum covers it and agrees."""
    from actors.config import ScorerConfig
    from actors.scorer import ScorerActor
    from cluster.weight_sync import free_port

    lrn = _learner(model_dir, True)
    lrn.train_step(scored_batch(make_actor(model_dir), model_dir), 1.0)
    actor = make_actor(model_dir)
    scorer = ScorerActor(ScorerConfig(), model_dir, adapter=DistillSparseConfig(enabled=True))
    assert [e[:2] for e in lrn.weight_spec()] == [e[:2] for e in actor.weight_spec()] == \
        [e[:2] for e in scorer.weight_spec()]
    assert lrn.weight_spec()[-1][0].startswith(lora.PREFIX)
    port = free_port()
    got = {}

    def join(name, who, rank):
        who.init_weight_sync("127.0.0.1", port, rank, 3, timeout_s=60)
        got[name] = who.sync_weights()

    ths = [threading.Thread(target=join, args=a) for a in (("r", actor, 1), ("s", scorer, 2))]
    for th in ths:
        th.start()
    lrn.init_weight_sync("127.0.0.1", port, 3, "gloo", bucket_mb=1)
    assert lrn.broadcast_weights() == 1
    for th in ths:
        th.join(60)
    assert got == {"r": 1, "s": 1}
    ref = lrn.state_checksum()
    assert actor.state_checksum() == pytest.approx(ref, rel=1e-9)
    assert scorer.state_checksum() == pytest.approx(ref, rel=1e-9)
    sent = dict(lrn.distill.named())
    for n, x in actor.adapter.tensors.items():
        assert torch.equal(x, sent[n]), n
    q = "model.layers.0.self_attn.q_proj"
    a, b = sent[f"{lora.PREFIX}{q}.lora_A"], sent[f"{lora.PREFIX}{q}.lora_B"]
    base_w = dict(lrn.named_weights())[f"{q}.weight"]
    merged = dict(actor.adapter.model.named_parameters())[f"{q}.weight"]
    assert torch.allclose(merged, base_w + lora.scale(lrn.distill.cfg) * b @ a, atol=1e-6)
    assert torch.equal(dict(actor.engine.model.named_parameters())[f"{q}.weight"], base_w)
    assert torch.equal(dict(scorer.model.named_parameters())[f"{q}.weight"], base_w)


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_restores_the_adapter_and_hf_export_keeps_the_base(model_dir, tmp_path, stage):
    from peft import PeftModel

    t = scored_batch(make_actor(model_dir), model_dir)
    a = _learner(model_dir, True, zero_stage=stage)
    a.train_step(dict(t), 1.0)
    a.save_checkpoint(str(tmp_path / "ckpt"))
    a.train_step(dict(t), 1.0)
    b = _learner(model_dir, True, zero_stage=stage)
    assert b.load_checkpoint(str(tmp_path / "ckpt")) == 1
    b.train_step(dict(t), 1.0)
    for (n, x), (_, y) in zip(a.distill.named(), b.distill.named()):
        assert torch.equal(x, y), n   # same adapter step 2: weights and Adam moments came back
    out = a.save_hf(str(tmp_path / "final"))
    base = load_model(out)
    assert checksum(base.named_parameters()) == pytest.approx(
        checksum(a.named_weights()), rel=1e-9)                      # the export is the base model
    peft = PeftModel.from_pretrained(load_model(out), os.path.join(out, "distill_sparse"))
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        with_adapter = token_logprobs(peft, ids, mask)
        without = token_logprobs(base, ids, mask)
    assert (with_adapter - without).abs().max() > 1e-4
    c = _learner(model_dir, False, zero_stage=stage)
    c.save_checkpoint(str(tmp_path / "plain"))
    with pytest.raises(FileNotFoundError, match="distill_sparse"):
        _learner(model_dir, True, zero_stage=stage).load_checkpoint(str(tmp_path / "plain"))


# ---- end to end -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("learner", [[], ["learner.zero_stage=3", "learner.num_learners=2",
                                         "rollout.num_actors=1"]], ids=["zero1", "zero3x2"])
def test_train_py_with_distill_sparse_trains_the_adapter_and_resumes(tiny_model, tmp_path,
                                                                     learner):
    """2 steps of launch/train.py with the adapter on: every actor's checksum (base + adapter)
    equals the learner's after each broadcast, the adapter moved, the export keeps it beside the
    base; a resume from the step-2 checkpoint restores it and trains on. Under ZeRO-3 with two
    learners the broadcast streams the gathered base, then the adapter."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    from conftest import REPO, SMALL_JOB, train_env

    def run(*args):
        proc = subprocess.run([sys.executable, "launch/train.py", *args], cwd=REPO,
                              env=train_env(tmp_path), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    out = tmp_path / "runs"
    run(f"rollout.model_path={tiny_model}", "run.steps=2", "run.checkpoint_every=2", *SMALL_JOB,
        "rollout.distill_sparse.enabled=true", "rollout.distill_sparse.lr=0.01",
        f"run.out_dir={out}", *learner)
    (run_dir,) = out.iterdir()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if "weights/checksum" in r]
    assert len(syncs) == 3 and all(r["weights/max_rel_diff"] == 0.0 for r in syncs)
    steps = [r for r in records if "distill/optimizer_steps" in r]
    assert [r["distill/optimizer_steps"] for r in steps] == [1.0, 1.0]
    adapter = load_file(str(run_dir / "final" / "distill_sparse" / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapter.items())
    run(f"resume={run_dir}", "run.steps=3")
    resumed = next(p for p in out.iterdir() if p != run_dir)
    again = load_file(str(resumed / "final" / "distill_sparse" / "adapter_model.safetensors"))
    assert set(again) == set(adapter)
    assert any(not torch.equal(again[k], adapter[k]) for k in adapter)


def test_written_adapter_is_what_peft_and_read_adapter_load(model_dir, tmp_path):
    """``lora.write_adapter`` (the folder the vLLM engine hands to its LoRA) is a peft folder: peft
    loads it as the sampler ``lora.merge`` builds, ``read_adapter`` gives the tensors back."""
    from peft import PeftModel

    cfg = DistillSparseConfig(enabled=True)
    base = load_model(model_dir)
    g = torch.Generator().manual_seed(0)
    tensors = {n: 0.2 * torch.randn(shape, generator=g)
               for n, shape, _ in lora.adapter_spec(base, cfg)}
    path = lora.write_adapter(tmp_path / "a", tensors, cfg)
    back = lora.read_adapter(path)
    assert set(back) == set(tensors) and all(torch.equal(back[n], tensors[n]) for n in tensors)
    merged = load_model(model_dir)
    lora.merge(merged, base, tensors, cfg)
    peft = PeftModel.from_pretrained(load_model(model_dir), str(path))
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(peft, ids, torch.ones_like(ids)),
                                   token_logprobs(merged, ids, torch.ones_like(ids)),
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not an adapter tensor"):
        lora.write_adapter(tmp_path / "b", {"model.norm.weight": torch.ones(3)}, cfg)


def test_bench_trains_an_adapter_and_measures_exact_agreement(model_dir, tmp_path):
    """bench/distill.py's functions (bench/schedule.py's DistillSparse rows): a zero adapter
    measures as the base sampler; a trained one is read back from a peft folder unchanged."""
    from bench.distill import agreement, rollout_config, train_adapter
    from learner.distill import SparseAdapter

    cfg = rollout_config(model_dir, budget=10, compress_every=4, max_new_tokens=24, samples=2,
                         distill=DistillSparseConfig(lr=1e-2))
    cfg.kv.obs_window = 4
    base = agreement(cfg, PROBLEMS)
    assert 0.0 <= base["agreement_p5"] <= base["agreement_mean"] < 1.0 and base["tokens"] > 0
    zero = {n: torch.zeros_like(t) for n, t in make_actor(model_dir).adapter.tensors.items()}
    assert agreement(cfg, PROBLEMS, zero) == base
    adapter, history = train_adapter(cfg, PROBLEMS, steps=2, prompts_per_step=2, log=None)
    assert len(history) == 2 and any(t.abs().max() > 0 for n, t in adapter.items() if "B" in n)
    model = load_model(model_dir)
    holder = SparseAdapter(cfg.distill_sparse, model_dir, dict(model.named_parameters()),
                           torch.float32)
    with torch.no_grad():
        for n, p in holder.params.items():
            p.copy_(adapter[n])
    holder.save(tmp_path, optimizer=False)
    back = lora.read_adapter(tmp_path / "distill_sparse")
    assert set(back) == set(adapter) and all(torch.equal(back[n], adapter[n]) for n in adapter)


def _dp_worker(rank, world, port, model_dir, path, q, stage=1):
    import traceback

    torch.set_num_threads(1)
    try:
        from learner.batch import shard_batch
        from learner.learner import Learner

        shard = shard_batch(torch.load(path, weights_only=True), world)[rank]
        cfg = LearnerConfig(num_learners=world, lr=1e-3, micro_batch_size=3, mini_batches=2,
                            zero_stage=stage)
        lrn = Learner(cfg, CorrectionConfig(), model_dir, rank=rank, world_size=world,
                      master_port=port, distill=DistillSparseConfig(enabled=True, lr=1e-2))
        m = lrn.train_step(shard, 1.0)
        # ZeRO-3: no gathered base weight outlives the adapter's step (the stubs are empty again)
        held = sum(p.numel() for p in lrn.distill.model.parameters() if not p.requires_grad)
        q.put((rank, "ok", (m["distill/optimizer_steps"],
                            {n: t.numpy().copy() for n, t in lrn.distill.named()}, held)))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_two_learners_train_the_same_adapter_as_one(model_dir, tmp_path, stage):
    """Data parallel: ranks sum the adapter's gradients (each its share of the global token
    mean), so two ranks hold the same adapter, equal to one learner's on the whole batch; rank 1
    has no row in the second mini-batch and still takes part in its step. Under ZeRO-3 every rank
    gathers the partitioned base for the adapter's step and holds none of it afterwards."""
    import multiprocessing as mp

    from bench.distill import scored_batch as scored
    from cluster.weight_sync import free_port
    from learner.learner import Learner

    batch = scored(make_actor(model_dir), load_model(model_dir), PROBLEMS, 0, mini_batches=2)
    torch.save(batch, tmp_path / "batch.pt")
    ctx, port = mp.get_context("spawn"), free_port()
    q = ctx.Queue()
    procs = [ctx.Process(target=_dp_worker,
                         args=(r, 2, port, model_dir, tmp_path / "batch.pt", q, stage))
             for r in range(2)]
    for p in procs:
        p.start()
    res = dict((r, (s, out)) for r, s, out in (q.get(timeout=300) for _ in procs))
    for p in procs:
        p.join(timeout=30)
    assert all(s == "ok" for s, _ in res.values()), res
    (steps0, a0, held0), (steps1, a1, held1) = res[0][1], res[1][1]
    assert steps0 == steps1 == 2
    if stage == 3:
        assert held0 == held1 == 0
    for n in a0:
        assert (a0[n] == a1[n]).all(), n
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=3, mini_batches=2)
    single = Learner(cfg, CorrectionConfig(), model_dir, master_port=_PORT,
                     distill=DistillSparseConfig(enabled=True, lr=1e-2))
    single.train_step(dict(batch), 1.0)
    for n, t in single.distill.named():
        torch.testing.assert_close(torch.from_numpy(a0[n]), t, rtol=1e-4, atol=2e-5)
