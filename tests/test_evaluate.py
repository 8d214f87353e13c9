"""launch/evaluate.accuracy_before: step 5 of launch/train.py, without Ray (evaluate_sets faked)."""
from launch import evaluate as ev


class _Log:
    progress = False

    def __init__(self):
        self.records = []

    def write(self, record, show=()):
        self.records.append(record)


def _fake_sets(calls):
    def evaluate_sets(actors, sets, greedy, progress=False):
        calls.append((tuple(sets), greedy))
        return {"eval/accuracy": 0.25, "eval/gsm8k/accuracy": 0.5}
    return evaluate_sets


def test_fresh_run_evaluates_every_set_once_and_logs_step_0(monkeypatch, capsys):
    calls, log = [], _Log()
    monkeypatch.setattr(ev, "evaluate_sets", _fake_sets(calls))
    sets = {"heldout": [1, 2, 3], "gsm8k": [4]}
    assert ev.accuracy_before({"step": 0, "in_flight": 0}, [], sets, True, log) == 0.25
    assert calls == [(("heldout", "gsm8k"), True)]
    assert log.records == [{"step": 0, "eval/accuracy": 0.25, "eval/gsm8k/accuracy": 0.5}]
    assert "(3 held-out problems)" in capsys.readouterr().out


def test_resumed_run_keeps_its_first_runs_accuracy_even_when_zero(monkeypatch):
    calls, log = [], _Log()
    monkeypatch.setattr(ev, "evaluate_sets", _fake_sets(calls))
    assert ev.accuracy_before({"step": 7, "accuracy_before": 0.0}, [], {"heldout": [1]}, True,
                              log) == 0.0
    assert calls == [] and log.records == []
