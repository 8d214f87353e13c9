"""When a request's cache is compacted, and how many slots it holds: the native engine's rule.

Both sides of vLLM need it and must agree without talking to each other: the scheduler (how many
KV blocks a request needs, which tail blocks to free) and the model runner (when to score and
compact, which slot a new token is written to). Both derive it from the same inputs: the
``rollout.kv`` budget schedule, ``compress_every`` (N) and the request's prefill length P (the
prompt, or prompt + outputs when a preempted request is recomputed).

The rule is ``actors/native/engine.py``'s:

* prefill: the cache holds every processed token (chunks included);
* before writing position t = P (the first decode step): if P > budget(P), cut to budget(P)
  (the native engine compresses a long prompt right after its prefill);
* before writing any position t: if the cache holds n >= budget(t) + N slots, cut to budget(t);
* then the token at t is written (n += 1).

``budget(t)`` is the budget of t's position bin (``rollout.kv.budgets`` per ``bin_tokens``, the
last bin's beyond the schedule; a static budget is the one-bin case).
"""
from __future__ import annotations

from dataclasses import dataclass

from actors.config import KVConfig, KVPolicy

# Requests whose id starts with this are never compacted (evaluation decodes densely on the same
# engine): vLLM keeps the caller's id as the prefix of its internal one, so both the scheduler and
# the runner see it.
DENSE_PREFIX = "dense:"


class BudgetTable:
    """Budget per position for one engine (``NativeEngine.budget_at`` for one position)."""

    def __init__(self, kv: KVConfig):
        self.policy = KVPolicy(getattr(kv.policy, "value", kv.policy))
        self.budgets = kv.bin_budgets()
        self.bin_tokens = int(kv.bin_tokens)
        self.every = int(kv.compress_every)

    def at(self, position: int) -> int:
        return self.budgets[min(position // self.bin_tokens, len(self.budgets) - 1)]

    @property
    def dense(self) -> bool:
        return self.policy == KVPolicy.dense

    def for_request(self, request_id: str) -> "BudgetTable":
        """This table, or a dense one for a request marked ``DENSE_PREFIX``."""
        return DENSE if request_id.startswith(DENSE_PREFIX) else self


@dataclass
class Step:
    """The cache of one request right before it writes position ``t``."""
    t: int
    held: int          # slots held before any compaction due at t
    length: int        # slots held after it (the new token goes to slot ``length``)

    @property
    def compacts(self) -> bool:
        return self.length < self.held

    @property
    def offset(self) -> int:
        """True position minus slot for every token written from now on."""
        return self.t - self.length


class CacheLength:
    """One request's cache length as it advances (positions only ever grow, one step at a time
    or a prefill chunk at a time); ``at(t)`` is O(positions since the last call)."""

    def __init__(self, table: BudgetTable, prefill_len: int):
        self.table, self.prefill_len = table, int(prefill_len)
        self._t, self._n = 0, 0        # tokens processed, slots held after processing them
        self._last: Step | None = None  # scheduler and runner ask for the same t several times

    def _before(self, t: int, n: int) -> int:
        """Slots held right before writing t, after any compaction due there."""
        if self.table.dense or t < self.prefill_len:
            return n
        budget = self.table.at(t)
        if t == self.prefill_len and n > budget:
            return budget
        return budget if n >= budget + self.table.every else n

    def at(self, t: int) -> Step:
        """The cache right before writing position ``t`` (``t`` never decreases)."""
        if self._last is not None and self._last.t == t:
            return self._last
        if t < self._t:
            raise ValueError(f"cache length asked for position {t} after {self._t} (positions "
                             "only grow; a recomputed request needs a new CacheLength)")
        while self._t < t:
            self._n = self._before(self._t, self._n) + 1
            self._t += 1
        self._last = Step(t, self._n, self._before(t, self._n))
        return self._last

    def next_compaction(self, t: int) -> int | None:
        """The first position after ``t`` whose write is preceded by a compaction (None: never),
        without advancing: the runner records queries only in the observation window before it."""
        if self.table.dense:
            return None
        n = self.at(t).length
        horizon = max(self.prefill_len - t, 0) + max(self.table.budgets) + self.table.every + 2
        for u in range(t + 1, t + horizon):
            n += 1                                   # position u - 1 was written
            if self._before(u, n) < n:
                return u
        return None


DENSE = BudgetTable(KVConfig(policy="dense"))
