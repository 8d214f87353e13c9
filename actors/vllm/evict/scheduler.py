"""The scheduler side of score-based eviction: blocks sized by the compacted cache, tail freed.

vLLM's KV cache manager gives a request ``cdiv(num_computed_tokens + new, block_size)`` blocks.
With eviction a request holds only ``CacheLength.at(t).length`` slots (``rule.py``), so the
hooks (installed by ``install.py`` on the in-process engine core) do two things:

* while ``allocate_slots`` runs for a request, the coordinator's block arithmetic
  (``get_num_blocks_to_allocate``, ``allocate_new_blocks``) sees token counts minus the
  request's offset (position - slot): the request is allocated for the slots it really fills;
* when the step compacts the request, and only once its allocation succeeded (so a request left
  unscheduled keeps its data), the blocks past those the compacted cache and the step's new
  tokens need are returned to the block pool. The runner compacts before anything else
  touches the pool's blocks in that step (``worker.py``), so the freed blocks can go to other
  requests, or admit new ones, in the very same step;
* admission reserves: vLLM admits a waiting request whenever its prompt fits and preempts
  (frees, to recompute from scratch) when running requests later run out of blocks. A request
  that evicts holds at most ``cdiv(max budget + N, block)`` blocks once decoding, so a new
  request is admitted only if the free blocks cover that for it (or its whole prompt, if
  longer) plus what every running request may still grow to: the pool then fills to its
  capacity and nobody is preempted for a request admitted too early (a recomputed request
  re-prefills its whole sequence densely).

A preempted request is recomputed from scratch (vLLM frees all its blocks); its cache is then
rebuilt densely from prompt + outputs and compacted from there (prefill length = all its tokens).
"""
from __future__ import annotations

from vllm.v1.request import RequestStatus

from actors.config import KVConfig
from actors.vllm.evict.rule import BudgetTable, CacheLength


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SchedulerEviction:
    def __init__(self, scheduler, kv: KVConfig):
        self.table = BudgetTable(kv)
        self.manager = scheduler.kv_cache_manager
        self.coordinator = self.manager.coordinator
        managers = self.coordinator.single_type_managers
        if len(managers) != 1:
            raise ValueError(f"KV eviction on vLLM needs one KV cache group, got {len(managers)}")
        self.blocks = managers[0]
        self.block_size = int(self.blocks.block_size)
        self.scheduler = scheduler
        self.cap_blocks = _cdiv(max(self.table.budgets) + self.table.every, self.block_size)
        self.refused = 0                           # admissions deferred by the reservation
        self.rules: dict[str, CacheLength] = {}
        self.offset: dict[str, int] = {}           # set only while allocate_slots runs
        self.freed_blocks = 0                      # returned to the pool by compactions
        self._wrap()

    def _wrap(self) -> None:
        allocate = self.manager.allocate_slots
        count, grow = self.coordinator.get_num_blocks_to_allocate, \
            self.coordinator.allocate_new_blocks
        free = self.manager.free
        shifted = ("num_tokens", "num_tokens_main_model", "total_computed_tokens",
                   "num_local_computed_tokens")

        # vLLM 0.32 passes these by keyword (count) and positionally (grow): the version check
        # in install.py pins that; no signature binding on this per-request, per-step path
        def count_blocks(**kwargs):
            off = self.offset.get(kwargs["request_id"], 0)
            if off:
                for name in shifted:
                    if name in kwargs:
                        kwargs[name] -= off
            return count(**kwargs)

        def allocate_new(request_id, num_tokens, num_tokens_main_model, *args, **kwargs):
            off = self.offset.get(request_id, 0)
            return grow(request_id, num_tokens - off, num_tokens_main_model - off, *args,
                        **kwargs)

        def allocate_slots(request, num_new_tokens, *args, **kwargs):
            return self._allocate(allocate, request, num_new_tokens, args, kwargs)

        def free_request(request):
            self.rules.pop(request.request_id, None)
            return free(request)

        self.coordinator.get_num_blocks_to_allocate = count_blocks
        self.coordinator.allocate_new_blocks = allocate_new
        self.manager.allocate_slots = allocate_slots
        self.manager.free = free_request

    def rule(self, request) -> CacheLength:
        rid, t = request.request_id, int(request.num_computed_tokens)
        rule = self.rules.get(rid)
        if rule is None or (t == 0 and rule._t > 0):      # new, or recomputed after preemption
            rule = self.rules[rid] = CacheLength(self.table.for_request(rid),
                                                 int(request.num_tokens))
        return rule

    def _room_for(self, request) -> bool:
        """Whether a waiting (or preempted) request may start: free blocks >= its own peak plus
        what every running request may still grow to (``cap_blocks`` each)."""
        if self.table.for_request(request.request_id).dense:
            return True                # a dense request (evaluation) is vLLM's usual business
        held = self.blocks.req_to_blocks
        reserve = sum(max(0, self.cap_blocks - len(held.get(r.request_id, ())))
                      for r in self.scheduler.running
                      if not self.table.for_request(r.request_id).dense)
        need = max(self.cap_blocks, _cdiv(int(request.num_tokens), self.block_size))
        return self.manager.block_pool.get_num_free_blocks() >= reserve + need

    def _allocate(self, allocate, request, num_new_tokens, args, kwargs):
        rid = request.request_id
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and \
                not self._room_for(request):
            self.refused += 1
            return None
        step = self.rule(request).at(int(request.num_computed_tokens))
        self.offset[rid] = step.offset
        try:
            blocks = allocate(request, num_new_tokens, *args, **kwargs)
        finally:
            self.offset.pop(rid, None)
        if blocks is not None and step.compacts:
            lookahead = int(kwargs.get("num_lookahead_tokens", 0) or 0)
            keep = _cdiv(step.length + int(num_new_tokens) + lookahead, self.block_size)
            held = self.blocks.req_to_blocks[rid]
            tail = held[keep:]
            del held[keep:]
            self.manager.block_pool.free_blocks(reversed(tail))
            self.freed_blocks += len(tail)
        return blocks
