"""The model-runner side of score-based eviction: observe, score, compact, re-address.

Three hooks on vLLM's model runner (installed by ``install.py``), all in the runner's own process:

1. ``execute_model`` (before): every scheduled request whose cache is due for compaction at the
   position it is about to write (``rule.CacheLength``) is scored with the native engine's policy
   code (``actors.native.policies.select``, one kept set per layer and KV head) and compacted:
   its kept keys and values move to slots [0, budget) of its own blocks, in place
   (``layout.CellMap``), and its block list is cut to the blocks it still needs. Requests due
   together and cut to the same length form one batch. The scheduler
   has already returned the rest to the pool (``scheduler.py``); nothing has written to them yet,
   because this runs before the step's state update zeroes newly allocated blocks.
2. ``_prepare_inputs`` (after): vLLM computed positions, sequence lengths and the slot mapping
   from the request's token count. Positions stay the true ones (RoPE, so the model sees the
   tokens where they are); sequence lengths and slot mapping are recomputed from the compacted
   slot, position - offset, so attention reads the compacted cache and new tokens land right
   after it.
3. attention ``impl.forward`` (after the kernel): queries are copied into a ring of
   ``obs_window`` per request and layer (SnapKV, R-KV), only at the positions the request's next
   compaction will read (the last ``obs_window`` before it); for H2O the attention each cached
   key receives is accumulated (an extra q.K pass: the fused kernels return no probabilities).

Per request the runner keeps the absolute position of every slot (kept sets per layer and head
after a compaction, then consecutive) and, with ``trace=True``, the native engine's trace
(``after``, kept positions [L, Hkv, budget]) so ``actors.native.reference`` can recompute the
sampler's log-probs over the kept sets.
"""
from __future__ import annotations

import numpy as np
import torch

from actors.config import KVConfig, KVPolicy
from actors.native import policies
from actors.vllm.evict.layout import CellMap
from actors.vllm.evict.rule import BudgetTable, CacheLength, Step

WINDOW_POLICIES = (KVPolicy.snapkv, KVPolicy.rkv)


def _slots(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[r, h, idx[r, h, j]]: [R, Hkv, b, D] from x [R, Hkv, S, D] (contiguous), whole rows of
    D at a time (``gather`` with an index expanded over D is several times slower)."""
    r, h, s, d = x.shape
    rows = idx + (torch.arange(r * h, device=x.device) * s).view(r, h, 1)
    return x.reshape(r * h * s, d).index_select(0, rows.reshape(-1)).view(r, h, -1, d)


class RequestKV:
    """Runner-side state of one request."""

    def __init__(self, table: BudgetTable, prefill_len: int, prompt_len: int, ring: int | None):
        self.rule = CacheLength(table, prefill_len)
        self.prompt_len, self.ring = prompt_len, ring
        self.kept: torch.Tensor | None = None      # [L, Hkv, k] positions of slots [0, k)
        self.offset = 0                            # position - slot for slots >= k
        self.acc: torch.Tensor | None = None       # [L, Hkv, cap] accumulated attention (H2O)
        self.next_t: int | None = None             # the next compaction's position, once known
        self.trace: list[tuple[int, torch.Tensor]] = []

    def positions(self, n: int, layers: int, heads: int) -> torch.Tensor:
        """Absolute positions of slots [0, n): [L, Hkv, n]."""
        if self.kept is None:
            return torch.arange(n).expand(layers, heads, n)
        k = self.kept.shape[-1]
        tail = (torch.arange(k, n) + self.offset).expand(layers, heads, n - k)
        return torch.cat([self.kept, tail], dim=-1)


class Evictor:
    def __init__(self, runner, kv: KVConfig, trace: bool = False):
        self.runner, self.kv, self.trace = runner, kv, trace
        self.policy = KVPolicy(getattr(kv.policy, "value", kv.policy))
        self.table = BudgetTable(kv)
        groups = runner.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"KV eviction on vLLM needs one KV cache group, the model has "
                             f"{len(groups)}")
        spec = groups[0].kv_cache_spec
        self.block_size = int(spec.block_size)
        from vllm.model_executor.models.utils import extract_layer_index

        ctx = runner.compilation_config.static_forward_context
        names = sorted(groups[0].layer_names, key=extract_layer_index)
        self.layers = [ctx[n] for n in names]
        impl = self.layers[0].impl
        self.hq, self.hkv = int(impl.num_heads), int(impl.num_kv_heads)
        self.head_dim, self.scaling = int(impl.head_size), float(impl.scale)
        self.maps = self._probe(runner.kv_cache_config.num_blocks)
        self.states: dict[str, RequestKV] = {}
        self.done: dict[str, list] = {}            # finished requests' traces until fetched
        self.w = int(kv.obs_window) if self.policy in WINDOW_POLICIES else 0
        self.rings: list[torch.Tensor] = []
        self.free_rings: list[int] = []
        self.plan: dict | None = None

    # ---- setup -----------------------------------------------------------------------------------
    def cache(self, i: int) -> torch.Tensor:
        kv = self.layers[i].kv_cache
        return kv[0] if isinstance(kv, (list, tuple)) else kv

    def _probe(self, num_blocks: int) -> list[CellMap]:
        """One cell map per distinct cache geometry (usually one for all layers)."""
        maps, by_geometry = [], {}
        for i, layer in enumerate(self.layers):
            kv = self.cache(i)
            key = (tuple(kv.shape), kv.stride(), kv.dtype)
            if key not in by_geometry:
                def write(k, v, scratch, slots, layer=layer):
                    layer.impl.do_kv_cache_update(layer, k, v, scratch, slots)
                by_geometry[key] = CellMap.probe(write, kv, num_blocks, self.block_size,
                                                 self.hkv, self.head_dim)
            maps.append(by_geometry[key])
        return maps

    def _ring_slot(self) -> int | None:
        """A free ring (obs_window query rows per layer) for a new request; rings double when
        every one is taken."""
        if not self.w:
            return None
        if not self.free_rings:
            have = len(self.rings[0]) // self.w if self.rings else 0
            grow = max(8, have)
            dev, dt = self.cache(0).device, self.cache(0).dtype
            extra = torch.zeros(grow * self.w, self.hq * self.head_dim, dtype=dt, device=dev)
            self.rings = ([torch.cat([r, extra]) for r in self.rings] if self.rings else
                          [extra.clone() for _ in self.layers])
            self.free_rings = list(range(have + grow - 1, have - 1, -1))
        return self.free_rings.pop()

    def _drop(self, req_id: str, keep_trace: bool) -> None:
        st = self.states.pop(req_id, None)
        if st is None:
            return
        if st.ring is not None:
            self.free_rings.append(st.ring)
        if keep_trace and self.trace:
            self.done[req_id] = st.trace

    def _start(self, req_id: str, prefill_len: int, prompt_len: int) -> None:
        old = self.states.get(req_id)
        if old is not None and old.ring is not None:
            self.free_rings.append(old.ring)
        table = self.table.for_request(req_id)
        st = RequestKV(table, prefill_len, prompt_len, None if table.dense else self._ring_slot())
        if old is not None:
            st.trace = old.trace          # a recomputed request keeps its earlier compactions
        if self.policy == KVPolicy.h2o and not table.dense:
            cap = max(prefill_len, max(self.table.budgets) + self.table.every) + 1
            st.acc = torch.zeros(len(self.layers), self.hkv, cap, device=self.cache(0).device)
        self.states[req_id] = st

    # ---- hook 1: before the step -----------------------------------------------------------------
    @torch.no_grad()
    def before_step(self, out) -> None:
        """Track requests (new, resumed, finished) and compact those due at this step."""
        self.plan = None
        for rid in out.finished_req_ids:
            self._drop(rid, keep_trace=True)
        for req in out.scheduled_new_reqs:
            self._start(req.req_id, len(req.prompt_token_ids), len(req.prompt_token_ids))
        cached = out.scheduled_cached_reqs
        due: dict[int, list] = {}
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids or rid not in self.states:
                state = self.runner.requests[rid]
                total = len(state.prompt_token_ids) + cached.num_output_tokens[i]
                self._start(rid, total, len(state.prompt_token_ids))
                continue
            step = self.states[rid].rule.at(int(cached.num_computed_tokens[i]))
            if step.compacts:
                due.setdefault(step.length, []).append(
                    (rid, step, int(out.num_scheduled_tokens[rid])))
        for group in due.values():          # one batch per kept length (per-bin budgets differ)
            self._compact(group)

    def _compact(self, group: list[tuple[str, Step, int]]) -> None:
        """Score and compact the requests of ``group`` (rid, step, tokens scheduled), all cut to
        the same length b, together: per layer their blocks are read once, one ``select`` runs
        over the batch, and the kept K/V go back to each request's first blocks."""
        states = [self.states[rid] for rid, _, _ in group]
        steps = [step for _, step, _ in group]
        b, nl, bs = steps[0].length, len(self.layers), self.block_size
        held = torch.tensor([st.held for st in steps])
        s = int(held.max())
        blocks = self._blocks([rid for rid, _, _ in group], s)
        pos_all = torch.stack([torch.nn.functional.pad(st.positions(n, nl, self.hkv),
                                                       (0, s - n), value=-1)
                               for st, n in zip(states, held.tolist())])   # [R, L, Hkv, S]
        protect = (torch.tensor([st.prompt_len for st in states]) if self.kv.protect_prompt
                   else None)
        seen = torch.tensor([step.t for step in steps])
        valid = torch.arange(s)[None] < held[:, None]                        # [R, S]
        ragged = not bool(valid.all())
        kept = []
        for i in range(nl):
            kv, cmap = self.cache(i), self.maps[i]
            dev = kv.device
            chunks = cmap.read(kv, blocks)
            all_k = cmap.unpack(chunks, "k")                                # [R, Hkv, NB*B, D]
            keys = all_k[:, :, :s]
            if ragged:      # slots beyond a row's length may hold stale keys (and are free)
                keys.masked_fill_(~valid[:, None, :, None].to(dev), 0)
            pos, n = pos_all[:, i].to(dev), held.to(dev)
            win = None
            if self.w:
                q = self.rings[i].view(-1, self.w, self.hq, self.head_dim)
                q = q[torch.tensor([st.ring for st in states], device=dev)].transpose(1, 2)
                win = policies.window_logits(q, seen.to(dev), keys, pos, n, self.scaling)
            acc = None
            if states[0].acc is not None:
                acc = torch.stack([torch.nn.functional.pad(st.acc[i, :, :m], (0, s - m))
                                   for st, m in zip(states, held.tolist())])
            view = policies.LayerView(keys, pos, n, acc, win,
                                      None if protect is None else protect.to(dev))
            idx = policies.select(self.policy, self.kv, b, view)         # [R, Hkv, b], sorted
            # kept K/V to slots [0, b), rewritten as whole blocks (slots >= b are free: the
            # next token goes to slot b)
            keep = -(-b // bs) * bs
            all_v = cmap.unpack(chunks, "v")
            all_k[:, :, :b], all_v[:, :, :b] = _slots(keys, idx), _slots(all_v, idx)
            cmap.pack(chunks, "k", all_k[:, :, :keep])
            cmap.pack(chunks, "v", all_v[:, :, :keep])
            cmap.write(kv, blocks[:, :keep // bs], chunks)
            for j, st in enumerate(states):
                if st.acc is not None:
                    st.acc[i, :, :b] = st.acc[i, :, :int(held[j])].gather(1, idx[j])
                    st.acc[i, :, b:] = 0
            kept.append(pos.gather(2, idx).cpu())                         # [R, Hkv, b]
        kept_all = torch.stack(kept, dim=1)                                  # [R, L, Hkv, b]
        for j, ((rid, step, new_tokens), st) in enumerate(zip(group, states)):
            st.kept, st.offset, st.next_t = kept_all[j], step.t - b, None
            if self.trace:
                st.trace.append((step.t - 1, st.kept.clone()))
            self._cut_blocks(rid, -(-(b + new_tokens) // bs))

    def _blocks(self, rids: list[str], slots: int) -> torch.Tensor:
        """[R, NB] block ids holding slots [0, ``slots``) of each request; a shorter request
        repeats its last block (read only: those slots lie beyond its length)."""
        nb = -(-slots // self.block_size)
        ids = [self.runner.requests[rid].block_ids[0] for rid in rids]
        return torch.tensor([(x + x[-1:] * nb)[:nb] for x in ids], dtype=torch.long)

    def _cut_blocks(self, rid: str, keep: int) -> None:
        """The request keeps its first ``keep`` blocks (the scheduler freed the others)."""
        req = self.runner.requests[rid]
        del req.block_ids[0][keep:]
        row = self.runner.input_batch.req_id_to_index.get(rid)
        if row is not None:
            table = self.runner.input_batch.block_table[0]
            table.num_blocks_per_row[row] = min(int(table.num_blocks_per_row[row]), keep)

    # ---- hook 2: after vLLM prepared the inputs --------------------------------------------------
    @torch.no_grad()
    def after_prepare(self, num_scheduled: np.ndarray) -> None:
        """Compacted sequence lengths and slot mapping; the ring and H2O plans of this step."""
        r = self.runner
        batch = r.input_batch
        nreq = batch.num_reqs
        ids = batch.req_ids[:nreq]
        computed = batch.num_computed_tokens_cpu[:nreq].astype(np.int64)
        offsets = np.array([self.states[rid].rule.at(int(t)).offset if rid in self.states else 0
                            for rid, t in zip(ids, computed)], dtype=np.int64)
        num_scheduled = np.asarray(num_scheduled[:nreq], dtype=np.int64)
        total = int(num_scheduled.sum())
        req_idx = np.repeat(np.arange(nreq), num_scheduled)
        qpos = r.query_pos.np[:total].astype(np.int64)
        dev = r.positions.device
        if offsets.any():
            r.seq_lens[:nreq] -= torch.from_numpy(offsets).to(r.seq_lens.device, r.seq_lens.dtype)
            slots = r.positions[:total] - torch.from_numpy(offsets[req_idx]).to(dev)
            batch.block_table.compute_slot_mapping(nreq, r.query_start_loc.gpu[:nreq + 1], slots)
        plan: dict = {"total": total}
        if self.w:
            # a query is kept only in the observation window before its request's next
            # compaction (every compaction scores the last w queries before its position)
            rings = np.full(nreq, -1, dtype=np.int64)
            first = np.zeros(nreq, dtype=np.int64)       # first position worth recording
            for j, (rid, t) in enumerate(zip(ids, computed)):
                st = self.states.get(rid)
                if st is None or st.ring is None:
                    continue
                if st.next_t is None or st.next_t <= t:
                    st.next_t = st.rule.next_compaction(int(t))
                if st.next_t is not None:
                    rings[j], first[j] = st.ring, st.next_t - self.w
            positions = computed[req_idx] + qpos
            src = np.nonzero((rings[req_idx] >= 0) & (positions >= first[req_idx]))[0]
            dst = rings[req_idx[src]] * self.w + positions[src] % self.w
            if len(src):                        # dense-only steps (evaluation) have no rings
                plan["ring"] = (torch.from_numpy(src).to(dev), torch.from_numpy(dst).to(dev))
        if self.policy == KVPolicy.h2o:
            starts = np.concatenate([[0], np.cumsum(num_scheduled)[:-1]])
            plan["h2o"] = [(rid, int(s), int(k), int(t - o))
                           for rid, s, k, t, o in zip(ids, starts, num_scheduled, computed, offsets)
                           if k > 0 and rid in self.states and self.states[rid].acc is not None]
        self.plan = plan

    # ---- hook 3: after each layer's attention ----------------------------------------------------
    @torch.no_grad()
    def observe(self, i: int, query: torch.Tensor) -> None:
        plan = self.plan
        if plan is None:
            return
        q = query[:plan["total"]].reshape(plan["total"], self.hq * self.head_dim)
        if "ring" in plan:
            src, dst = plan["ring"]
            self.rings[i].index_copy_(0, dst, q.index_select(0, src).to(self.rings[i].dtype))
        if plan.get("h2o"):
            self._accumulate(i, q, plan["h2o"])

    def _accumulate(self, i: int, q: torch.Tensor, items: list) -> None:
        """H2O: add the attention of each request's k queries this step (slots before .. before
        + k - 1) to every cached slot's score, summed over the query heads of its KV group
        (causal); all requests of the step in one batch. ``items``: (rid, first query row, k,
        before) per request, ``q`` [tokens, Hq * D] the step's queries."""
        kv, cmap, dev = self.cache(i), self.maps[i], q.device
        n = [before + k for _, _, k, before in items]
        s, kmax, r = max(n), max(k for _, _, k, _ in items), len(items)
        blocks = self._blocks([rid for rid, _, _, _ in items], s)
        keys = cmap.unpack(cmap.read(kv, blocks), "k")[:, :, :s].float()   # [R, Hkv, S, D]
        rows = torch.stack([torch.arange(start, start + kmax) for _, start, _, _ in items])
        qs = q.index_select(0, rows.clamp(max=q.shape[0] - 1).reshape(-1).to(dev)).float()
        g = self.hq // self.hkv
        qh = qs.view(r, kmax, self.hkv, g, self.head_dim).permute(0, 2, 3, 1, 4)  # [R,Hkv,g,k,D]
        logits = torch.matmul(qh, keys[:, :, None].transpose(-1, -2)) * self.scaling
        qpos = torch.tensor([before for *_, before in items], device=dev)[:, None] + \
            torch.arange(kmax, device=dev)[None]                            # [R, k]
        real = torch.arange(kmax, device=dev)[None] < torch.tensor([k for _, _, k, _ in items],
                                                                    device=dev)[:, None]
        # causal, and nothing for padded queries (their rows become 0 after the softmax)
        hidden = (torch.arange(s, device=dev)[None, None] > qpos[..., None]) | ~real[..., None]
        logits = logits.masked_fill(hidden[:, None, None], float("-inf"))
        add = torch.softmax(logits, dim=-1).nan_to_num_(0.0).sum(dim=(2, 3))  # [R, Hkv, S]
        for j, (rid, *_rest) in enumerate(items):
            self.states[rid].acc[i, :, :n[j]] += add[j, :, :n[j]]

    # ---- results ---------------------------------------------------------------------------------
    def take_traces(self, req_ids: list[str]) -> dict[str, list]:
        """Traces of the given requests (finished or not); they are forgotten here."""
        out = {}
        for rid in req_ids:
            if rid in self.done:
                out[rid] = self.done.pop(rid)
            elif rid in self.states:
                out[rid] = self.states[rid].trace
                self._drop(rid, keep_trace=False)
        return out
