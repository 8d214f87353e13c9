"""bench/lookups.py and ``ReasoningTask.lookups``: where a response reads each operand, whether
it wrote the fact, and which statements of it a compressed cache still shows the query that
writes it (closed-form evictions), then the bench end to end on the small test model."""
from __future__ import annotations

import json

import pytest
import torch

from bench.lookups import main, tally, visible
from common.kept import NEVER
from tasks.reasoning import ReasoningTask

PROMPT = "ask a=7 b=5 c=4 do c+a-b\n"


def test_lookups_of_a_worked_response():
    task = ReasoningTask(n_train=1, n_heldout=1)        # 3 facts, the last operand (b) far
    response = task.solution(PROMPT)
    text = PROMPT + response
    near, far = task.lookups(PROMPT, response)
    assert (near.letter, near.far, near.right) == ("a", False, True)
    assert (far.letter, far.far, far.right) == ("b", True, True)
    assert text[near.at] == "7" and text[far.at] == "5"
    assert text[far.at - 12:far.at + 4] == "then r-b=11-5=6."
    # a far fact is stated in the prompt only; a near one in the prompt and every note before
    assert far.sources == (PROMPT.index("b=5") + 2,)
    assert near.sources[0] == PROMPT.index("a=7") + 2 and len(near.sources) > 3
    assert all(text[s] == "7" and text[s - 2:s] == "a=" for s in near.sources)
    assert all(s < near.at for s in near.sources)


def test_a_wrong_operand_and_the_far_facts_knob():
    task = ReasoningTask(n_train=1, n_heldout=1)
    response = task.solution(PROMPT)
    wrong = response.replace("then r-b=11-5=6.", "then r-b=11-3=8.")
    assert [lk.right for lk in task.lookups(PROMPT, wrong)] == [True, False]
    assert task.lookups(PROMPT, "no steps here") == []
    dense_all = ReasoningTask(n_train=1, n_heldout=1, far_facts=0)
    assert [lk.far for lk in dense_all.lookups(PROMPT, dense_all.solution(PROMPT))] == [False] * 2
    far_all = ReasoningTask(n_train=1, n_heldout=1, far_facts=2)
    lks = far_all.lookups(PROMPT, far_all.solution(PROMPT))
    assert [lk.far for lk in lks] == [True, True] and all(len(lk.sources) == 1 for lk in lks)


def test_visible_follows_the_kept_set_rule():
    ev = torch.full((2, 2, 10), NEVER, dtype=torch.int32)   # [layers, KV heads, positions]
    ev[0, 0, 3] = 5          # evicted by the compression after position 5
    ev[0, 1, [3, 4]] = 8
    ev[1, :, 3] = 6
    v = visible(ev, 7, [3])
    # q=7 sees k=3 where it was never evicted or evicted at a compression after q (8 >= 7)
    assert v.tolist() == [[False, True], [False, False]]
    assert visible(ev, 5, [3]).tolist() == [[True, True], [True, True]]
    # any source will do: k=4 was never evicted in layer 1 nor in layer 0's head 0
    assert visible(ev, 9, [3, 4]).tolist() == [[True, False], [True, True]]
    assert visible(ev, 9, [3]).tolist() == [[False, False], [False, False]]
    assert not visible(ev, 9, []).any()


def test_tally_by_hand():
    task = ReasoningTask(n_train=1, n_heldout=1)
    response = task.solution(PROMPT)
    total = len(PROMPT) + len(response)
    kept = torch.full((1, 2, total), NEVER, dtype=torch.int32)
    far_src = PROMPT.index("b=5") + 2
    evicted = kept.clone()
    evicted[0, 0, far_src] = len(PROMPT)      # head 0 loses the far fact early, head 1 keeps it
    wrong = response.replace("then r-b=11-5=6.", "then r-b=11-3=8.")
    out = tally(task, [PROMPT, PROMPT], [response, wrong], [kept, evicted])
    assert out["near"]["n"] == 2 and out["near"]["share_right"] == 1.0
    assert out["near"]["right"] == {"n": 2, "heads_seeing": [1.0], "lost": 0.0}
    assert out["near"]["wrong"] == {"n": 0, "heads_seeing": None, "lost": None}
    assert out["far"]["share_right"] == 0.5
    assert out["far"]["right"]["heads_seeing"] == [1.0]
    assert out["far"]["wrong"]["heads_seeing"] == [0.5] and out["far"]["wrong"]["lost"] == 0.0
    evicted[0, 1, far_src] = len(PROMPT)
    assert tally(task, [PROMPT], [wrong], [evicted])["far"]["wrong"]["lost"] == 1.0
    assert tally(task, [PROMPT], [response])["far"] == {"n": 1, "share_right": 1.0}


def test_lookups_bench_end_to_end(tiny_model, tmp_path, capsys):
    out = tmp_path / "l.json"
    res = main(["--model", str(tiny_model), "--problems", "4", "--json", str(out), "--",
                "rollout.max_new_tokens=24", "rollout.kv.budget=12", "rollout.kv.compress_every=4"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["problems"] == 4 and (res["policy"], res["budget"]) == ("rkv", 12)
    for name in ("dense", "sparse"):
        assert 0.0 <= res[name]["accuracy"] <= 1.0 and set(res[name]["lookups"]) == {"near", "far"}
    assert "rkv at 12 tokens" in capsys.readouterr().out


def test_lookups_bench_refuses_a_task_without_lookups(tiny_model):
    with pytest.raises(SystemExit, match="running_sum"):
        main(["--config", "launch/configs/default.yaml", "--model", str(tiny_model),
              "--problems", "2", "--", "rollout.max_new_tokens=8"])
