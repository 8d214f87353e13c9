"""The native sampler's draw: right distribution, never a zero-probability token, seeded."""
import torch

from actors.native.sampling import draw, sample


def test_draw_frequencies_match_the_probabilities():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3], [0.05, 0.05, 0.0, 0.9]])
    n = 40_000
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros_like(probs)
    for _ in range(n // 1000):
        tok = draw(probs.repeat_interleave(1000, dim=0), g).view(2, 1000)
        counts += torch.nn.functional.one_hot(tok, 4).sum(dim=1).float()
    freq = counts / n
    # binomial std at p=0.5, n=40k is 0.0025: 4 sigma
    assert torch.allclose(freq, probs, atol=0.01), freq
    assert counts[0, 1] == 0 and counts[1, 2] == 0


def test_zero_probability_tokens_are_never_drawn_at_the_edges(monkeypatch):
    """u = 0 and u just below 1 (the extremes of torch.rand), unnormalised mass, a one-hot row."""
    probs = torch.tensor([[0.0, 0.7, 0.0, 0.3, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 1.0],
                          [1.0, 0.0, 0.0, 0.0, 0.0],
                          [0.0, 0.33, 0.33, 0.33, 0.0]])   # sums to 0.99
    for u in (0.0, 1.0 - 2 ** -24):
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full(a, u, dtype=k["dtype"]))
        tok = draw(probs, None)
        assert (probs.gather(1, tok[:, None]) > 0).all(), (u, tok)
    monkeypatch.undo()
    assert draw(probs, None)[1:3].tolist() == [4, 0]


def test_sample_is_seeded_and_respects_top_k():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    a = sample(logits, 1.0, 5, 1.0, "processed", torch.Generator().manual_seed(7))
    b = sample(logits, 1.0, 5, 1.0, "processed", torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    top5 = logits.topk(5, dim=-1).indices
    assert (top5 == a[0][:, None]).any(dim=-1).all()
    # the recorded log-prob is the truncated distribution's: renormalised over the top 5
    ref = torch.log_softmax(logits.gather(1, top5), -1)
    pos = (top5 == a[0][:, None]).float().argmax(-1)
    assert torch.allclose(a[1], ref.gather(1, pos[:, None]).squeeze(1), atol=1e-6)
