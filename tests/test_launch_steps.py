"""Driver-side helpers: deterministic prompt order with a resumable position, even splits."""
import pytest

from launch.steps import PromptSampler, split


def test_sampler_is_deterministic_and_covers_epoch():
    items = list(range(10))
    a, b = PromptSampler(items, 4, seed=3), PromptSampler(items, 4, seed=3)
    first = a.next() + a.next()
    assert first == b.next() + b.next()
    rest = a.next()  # crosses into epoch 1
    assert sorted(first + rest[:2]) == items
    assert a.position() == {"epoch": 1, "index": 2, "drawn": 3}
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
