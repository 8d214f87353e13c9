"""make_base_model: a very small, very short build into tmp, reloaded with from_pretrained."""
from __future__ import annotations

import json

import pytest
import torch

from launch import make_base_model as mbm

pytestmark = pytest.mark.filterwarnings("ignore")


def _args(out, *extra):
    return mbm.parse_args(["--out", str(out), "--hidden", "32", "--layers", "1", "--heads", "2",
                           "--batch-size", "8", "--max-steps", "6", "--eval-every", "3",
                           "--n-eval", "4", "--min-terms", "2", "--max-terms", "3", "--n-train", "64",
                           "--n-heldout", "8", "--threads", "1", *extra])


def test_build_reload_and_cache(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "tiny"
    logs: list[str] = []
    mbm.build(_args(out, "--target-acc", "1.1"), log=logs.append)
    assert (out / mbm.MARKER).is_file() and (out / "model.safetensors").is_file()
    metrics = json.loads((out / mbm.METRICS).read_text())
    assert metrics["steps"] == 6 and len(metrics["history"]) == 2
    assert 0.0 <= metrics["heldout_acc_greedy"] <= 1.0 and metrics["task"]["min_terms"] == 2
    assert any("step" in line for line in logs)

    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 1
    enc = tok(["sum a1b2\n"], return_tensors="pt")
    assert model(**enc).logits.shape[-1] == model.config.vocab_size
    assert tok.decode(enc["input_ids"][0], skip_special_tokens=True) == "sum a1b2\n"

    # A complete directory is reused, not rebuilt, when the command asks for what it holds.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    logs.clear()
    mbm.build(_args(out, "--target-acc", "1.1"), log=logs.append)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp and "exists" in logs[0]
    # Built by another recipe: refused by name, and nothing is rebuilt or deleted.
    with pytest.raises(SystemExit, match=r"another recipe \(--target-acc: built 1.1, asked 0.35\)"):
        mbm.build(_args(out), log=logs.append)
    with pytest.raises(SystemExit, match=r"--settle-target: built 0.0, asked 0.5"):
        mbm.build(_args(out, "--target-acc", "1.1", "--settle-target", "0.5"), log=logs.append)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # A build that predates --settle-target (no such key recorded) had no second stage.
    m = json.loads((out / mbm.METRICS).read_text())
    for k in ("settle_target", "settle_lr", "settle_max_steps"):
        del m["args"][k]
    (out / mbm.METRICS).write_text(json.dumps(m))
    mbm.build(_args(out, "--target-acc", "1.1"), log=logs.append)
    with pytest.raises(SystemExit, match=r"--settle-target: built 0.0, asked 0.5"):
        mbm.build(_args(out, "--target-acc", "1.1", "--settle-target", "0.5"), log=logs.append)
    # Built under other CPU kernels (common/cpu_isa.py), or before they were recorded: not the
    # weights this process would build, so refused by name too.
    kernels = torch.backends.cpu.get_cpu_capability()
    assert m["cpu_capability"] == kernels
    for built in ("SOMETHING_ELSE", None):
        m["cpu_capability"] = built
        (out / mbm.METRICS).write_text(json.dumps({k: v for k, v in m.items() if v is not None}))
        shown = "'unrecorded'" if built is None else repr(built)
        with pytest.raises(SystemExit, match=f"CPU kernels: built {shown}, this process '{kernels}'"):
            mbm.build(_args(out, "--target-acc", "1.1"), log=logs.append)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_deterministic_from_seed(tmp_path):
    from safetensors.torch import load_file

    for name in ("a", "b"):
        mbm.build(_args(tmp_path / name, "--max-steps", "3", "--target-acc", "1.1"), log=lambda s: None)
    wa, wb = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("a", "b"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_stops_at_target(tmp_path):
    # target 0 is met at the first check: training stops there instead of at max_steps.
    out = tmp_path / "t"
    mbm.build(_args(out, "--target-acc", "0"), log=lambda s: None)
    assert json.loads((out / mbm.METRICS).read_text())["steps"] == 3


def test_init_from_starts_at_the_given_weights(tmp_path):
    from safetensors.torch import load_file

    mbm.build(_args(tmp_path / "a", "--max-steps", "3", "--target-acc", "1.1"), log=lambda s: None)
    # No SFT step: the new build's weights are exactly those it started from.
    mbm.build(_args(tmp_path / "b", "--max-steps", "0", "--init-from", str(tmp_path / "a")),
              log=lambda s: None)
    wa, wb = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("a", "b"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # One step later they differ: SFT went on from them.
    mbm.build(_args(tmp_path / "c", "--max-steps", "1", "--init-from", str(tmp_path / "a")),
              log=lambda s: None)
    wc = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_settle_stage_equals_a_second_build_from_the_first(tmp_path):
    """One command with --settle-target gives the weights of two: the first stage alone, then a
    build --init-from it with seed + 1, --settle-lr on a cosine over --settle-max-steps and
    --settle-target as the target (how the reasoning task's fifth base was first built)."""
    from safetensors.torch import load_file

    settle = ["--settle-target", "1.1", "--settle-max-steps", "4", "--settle-lr", "1e-3"]
    mbm.build(_args(tmp_path / "one", "--max-steps", "3", "--target-acc", "1.1", *settle),
              log=lambda s: None)
    mbm.build(_args(tmp_path / "first", "--max-steps", "3", "--target-acc", "1.1"),
              log=lambda s: None)
    mbm.build(_args(tmp_path / "two", "--init-from", str(tmp_path / "first"), "--seed", "1",
                    "--lr", "1e-3", "--lr-schedule", "cosine", "--max-steps", "4",
                    "--target-acc", "1.1"), log=lambda s: None)
    w1, w2 = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("one", "two"))
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    wf = load_file(str(tmp_path / "first" / "model.safetensors"))
    assert any(not torch.equal(wf[k], w1[k]) for k in wf)          # the second stage trained
    m = json.loads((tmp_path / "one" / mbm.METRICS).read_text())
    assert m["steps"] == 7 and m["settle"]["steps"] == 4 and m["settle"]["seed"] == 1
    assert m["heldout_acc_greedy"] == m["settle"]["heldout_acc_greedy"]   # the build reports the last check
    assert len(m["history"]) == 1 and len(m["settle"]["history"]) == 2   # checks every 3 steps


@pytest.mark.parametrize("bad, match", [
    (["--settle-target", "-0.1"], "--settle-target -0.1 must be >= 0"),
    (["--settle-target", "0.5", "--settle-max-steps", "0"], "--settle-max-steps 0 must be >= 1"),
    (["--settle-target", "0.5", "--settle-lr", "0"], "--settle-lr 0.0 > 0"),
])
def test_bad_settle_options_refused_by_name(tmp_path, bad, match):
    with pytest.raises(SystemExit, match=match):
        mbm.build(_args(tmp_path / "x", *bad), log=lambda s: None)
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp").exists()


def test_init_from_refuses_another_shape_or_an_incomplete_dir(tmp_path):
    mbm.build(_args(tmp_path / "a", "--max-steps", "0"), log=lambda s: None)
    with pytest.raises(SystemExit, match="hidden_size is 32 there, 64 for this build"):
        mbm.build(_args(tmp_path / "b", "--hidden", "64", "--max-steps", "0",
                        "--init-from", str(tmp_path / "a")), log=lambda s: None)
    with pytest.raises(SystemExit, match="not a complete base model directory"):
        mbm.build(_args(tmp_path / "c", "--max-steps", "0", "--init-from", str(tmp_path / "none")),
                  log=lambda s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_init_from_goes_on_to_more_positions_not_fewer(tmp_path):
    """A length curriculum: a longer task's build (more RoPE positions) starts from a shorter
    one's weights unchanged; a build with fewer positions than its source is refused by name."""
    from transformers import AutoTokenizer

    from common.modeling import load_model

    mbm.build(_args(tmp_path / "a", "--max-steps", "0"), log=lambda s: None)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    shape = dict(vocab_size=len(tok), hidden=32, layers=1, heads=2, tok=tok)
    longer = mbm.build_model(**shape, max_positions=2048)
    mbm.load_init(longer, tmp_path / "a")
    wa, wb = load_model(tmp_path / "a").state_dict(), longer.state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert longer.config.max_position_embeddings == 2048
    with pytest.raises(SystemExit, match="max_position_embeddings is 1024 there, 512 for this"):
        mbm.load_init(mbm.build_model(**shape, max_positions=512), tmp_path / "a")


def test_lr_schedule_warms_up_then_holds_or_decays_to_a_tenth():
    import math

    from launch.make_base_model import lr_lambda, parse_args

    const = lr_lambda(parse_args(["--task", "reasoning", "--max-steps", "1000"]), 50)
    cos = lr_lambda(parse_args(["--task", "reasoning", "--max-steps", "1000",
                                "--lr-schedule", "cosine"]), 50)
    warm = [cos(s) for s in range(50)]
    assert warm == [const(s) for s in range(50)] == [(s + 1) / 50 for s in range(50)]
    assert all(const(s) == 1.0 for s in range(49, 1000))
    decay = [cos(s) for s in range(49, 1000)]
    assert decay[0] == 1.0 and all(a > b for a, b in zip(decay, decay[1:]))
    assert math.isclose(decay[-1], 0.1) and math.isclose(cos(524), 0.55)
    with pytest.raises(SystemExit):
        parse_args(["--lr-schedule", "linear"])
