"""Driver-side helpers: deterministic prompt order with a resumable position, even splits."""
import pytest

from launch.rollouts import PromptSampler, split


def test_sampler_is_deterministic_and_covers_epoch():
    items = list(range(10))
    a, b = PromptSampler(items, 4, seed=3), PromptSampler(items, 4, seed=3)
    first = a.next() + a.next()
    assert first == b.next() + b.next()
    rest = a.next()  # crosses into epoch 1
    assert sorted(first + rest[:2]) == items
    assert a.position() == {"epoch": 1, "index": 2, "drawn": 3, "requeued": []}
    c = PromptSampler(items, 4, seed=3)
    c.restore(a.position())  # a resumed run continues with the very same batches
    assert [c.next() for _ in range(4)] == [a.next() for _ in range(4)] and c.drawn == a.drawn == 7
    with pytest.raises(ValueError, match="outside"):
        c.restore({"epoch": 0, "index": 11, "drawn": 1})
    assert PromptSampler(items, 4, seed=4).next() != PromptSampler(items, 4, seed=3).next()


def test_split_is_even_and_complete():
    parts = split(list(range(7)), 3)
    assert [len(p) for p in parts] == [3, 2, 2]
    assert sum(parts, []) == list(range(7))
    assert split([1], 3) == [[1], [], []]


def test_fill_rollouts_keeps_s_in_flight_counts_landed_ones_and_stops_at_the_last_batch():
    from collections import deque
    from types import SimpleNamespace

    from launch.rollouts import fill_rollouts

    calls = []

    class Method:
        def remote(self, chunk, version, batch):
            calls.append((version, batch))
            return f"ref{batch}"

    def pools(ahead):
        return SimpleNamespace(rollout=[SimpleNamespace(rollout=Method())], rollouts_ahead=ahead,
                               requeue=False)

    sampler = PromptSampler(list(range(10)), 2, seed=0)
    q = deque()
    fill_rollouts(q, pools(3), sampler, 0, steps=5)
    assert [b for _, _, b, _ in (e[0] for e in q)] == [1, 2, 3] and sampler.drawn == 3
    assert calls == [(None, 1), (None, 2), (None, 3)]  # ahead: the actors tag their own version
    q.popleft()
    fill_rollouts(q, pools(3), sampler, 1, steps=5)
    q.popleft()
    fill_rollouts(q, pools(3), sampler, 2, steps=5)  # batch 5 is the last one
    q.popleft()
    fill_rollouts(q, pools(3), sampler, 3, steps=5)
    assert sampler.drawn == 5 and len(q) == 2
    # resumed with two landed batches and s=1: nothing launched until they are gathered, and a
    # launch with s=1 is tagged with the driver's version
    calls.clear()
    q = deque([[], []])
    fill_rollouts(q, pools(1), PromptSampler(list(range(10)), 2, seed=0), 4, steps=5)
    assert len(q) == 2 and not calls
    q.popleft(), q.popleft()
    fill_rollouts(q, pools(1), PromptSampler(list(range(10)), 2, seed=0), 4, steps=5)
    assert calls == [(4, 1)]
