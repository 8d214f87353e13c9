"""Batched native generation engine with a compressed KV cache (the default rollout engine).

One call to ``generate`` runs the prompts in batches of ``batch_size``. Per batch:

1. Prefill: prompts are right-padded to the longest; every row gets positions 0..L_b-1, a causal mask
   over its own valid tokens, and its first token is sampled from the logits at L_b-1 (padding never
   enters the cache: row b simply has ``n[b] = L_b`` valid slots). A prompt longer than the budget is
   compressed right after prefill (SnapKV-style prompt compression; the prompt's own forward pass is
   dense, its full KV exists only transiently inside one layer's computation).
2. Decode: each step appends one token per row at slot ``n[b]``; a row whose cache is full
   (``n == budget + compress_every``) is first compressed to ``budget`` tokens by its KV policy, so
   compression happens every ``compress_every`` decode steps and no row stores more than
   ``budget + compress_every`` tokens per layer. ``budget`` is the one of the position bin the row
   is about to write (``rollout.kv.budgets`` per ``bin_tokens`` positions, ``set_budgets``; a
   static budget is the one-bin case); rows in different bins compress separately, and
   ``GenerationOutput.bin_budgets`` records the budget of every bin a sequence reached. The step
   itself (``step.py``) has fixed shapes and never waits for the device: the host mirrors every
   row's slot count and position by arithmetic (``batch.py``) and decides from that which rows
   compress or finish; the one device read of a step is its sampled tokens, and only when stop
   tokens or stop strings are in play. On CUDA the step is replayed as a CUDA graph.
   Rows that emit a stop token or reach ``max_new_tokens`` leave the batch at once: the last live
   rows move into their slots (``kvcache.KVPool.move_rows``). Stop strings
   (``SamplingParams.stop``) are matched by decoding each row's tail (``stops.py``): the token that
   completes one ends the row like a stop token (kept, finish_reason "stop").
3. Continuous batching: at most ``batch_size`` rows decode together; once half of them have left,
   waiting prompts are prefilled (step 1) into the free rows of the pool.

Log-probs are those of the distribution each token was sampled from (``sampling.py``). Memory: the
slot pool, allocated once per call (kept between calls of the same shape when the step is
captured), holds ``rows * cap`` tokens, rows = min(batch_size, prompts),
cap = ``budget + compress_every`` (sparse) or ``longest prompt + max_new_tokens`` (dense);
``GenerationOutput.peak_kv_bytes`` is the most tokens a sequence had stored (all layers, K and
V); ``last_stats`` has the pool's ``allocated_kv_bytes``, ``peak_kv_bytes`` (the most bytes held
at once by all live rows' valid slots) and ``attended_slots`` (KV slots a decode step reads per
row, on average: what attention costs). Transient extras not counted there: one layer's full
prompt KV while a long prompt is compressed at prefill.
Dtype: the model's (``rollout.dtype``); the cache is stored in it. In bf16 the logits are cast to
float32 before sampling, so log-probs are float32 everywhere, and attention keeps its softmax in
float32 (on the CPU its scores too: ``model.cpu_low_precision``).
Sampling: one ``torch.Generator`` seeded from ``SamplingParams.seed`` per call, so the same prompts,
seed and ``batch_size`` give the same samples. ``replay`` reads given responses teacher-forced
through the same prefill, policy and compressions, in chunks between compressions (``forced.py``),
and returns each step's full next-token log-probs (probes, ``actors/probes.py``).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np
import torch

from actors.config import KVConfig, KVPolicy
from actors.engine import GenerationOutput, SamplingParams
from actors.native import policies
from actors.native.batch import BatchState
from actors.native.forced import run_forced
from actors.native.kvcache import KVPool
from actors.native.model import Decoder, RopeTable, attend
from actors.native.sampling import processed_logprobs, sample
from actors.native.step import StepRunner
from actors.native.stops import StopMatcher, tokenizer_decoder


class NativeEngine:
    def __init__(self, model, kv: KVConfig | None = None, batch_size: int = 64, trace: bool = False,
                 decode: Callable[[list[int]], str] | None = None, step: str = "auto"):
        self.model = model
        # ids -> text, only for stop strings; default: the tokenizer saved with the model's weights
        # (HF records the directory in ``name_or_path``), loaded the first time a stop string is used
        self.decode = decode
        self.dec = Decoder(model)
        self.kv = kv or KVConfig()
        self.kv.validate("rollout.kv")
        self.policy = KVPolicy(self.kv.policy)
        self.budgets = self.kv.bin_budgets()     # per position bin (rollout.kv.bin_tokens)
        self.batch_size = batch_size
        self.trace = trace        # record compression events (kept positions) for tests
        self.version = 0
        self.device = next(model.parameters()).device
        self.last_stats: dict = {}
        self.stepper = StepRunner(step)     # eager, compiled, or CUDA graphs (step.py)
        self._kept_pool, self._rope = None, None

    @classmethod
    def from_config(cls, cfg, model_path: str) -> "NativeEngine":
        """Load the model for ``cfg`` on the device Ray assigned this process (a GPU only when it
        was given one: ``common.devices``), else the CPU."""
        from common.devices import assigned_device
        from common.dtypes import torch_dtype
        from common.modeling import load_model

        model = load_model(model_path, dtype=torch_dtype(cfg.dtype)).to(assigned_device())
        return cls(model, cfg.kv, cfg.batch_size, decode=tokenizer_decoder(model_path))

    # ---- weights -------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"load_weights: model has no parameter {name!r}")
            params[name].copy_(tensor.to(params[name].dtype))
        self.dec.invalidate()  # also after an empty list: the weights were received in place
        self.version = version

    def state_checksum(self) -> float:
        from common.modeling import checksum_of_sums

        return checksum_of_sums(self.weight_sums())

    def weight_sums(self) -> dict[str, float]:
        from common.modeling import abs_sum

        return {n: abs_sum(p) for n, p in self.model.named_parameters()}

    # ---- budget schedule -------------------------------------------------------------------------
    def set_budgets(self, budgets: list[int]) -> None:
        """Use ``budgets`` (one per position bin of ``kv.bin_tokens``) from the next call on;
        checked like ``rollout.kv.budgets``. A static budget is the one-bin schedule."""
        kv = replace(self.kv, budgets=[int(b) for b in budgets])
        kv.validate("rollout.kv")
        self.kv, self.budgets = kv, kv.bin_budgets()

    def budget_at(self, position: np.ndarray) -> np.ndarray:
        """Budget in force for rows about to write ``position`` [R] (host): its bin's budget, the
        last bin's beyond the schedule."""
        table = np.array(self.budgets, dtype=np.int64)
        return table[np.minimum(np.asarray(position) // self.kv.bin_tokens, len(table) - 1)]

    # ---- generation ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        """Continuous batching: up to ``batch_size`` sequences decode together; when half of them
        have finished, waiting prompts are prefilled and join the batch."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("native engine: empty prompt (every prompt needs at least one token)")
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(int(params.seed))

        def pick(logits, st):
            return sample(logits, params.temperature, params.top_k, params.top_p,
                          params.logprob_mode, gen)

        return self._run(prompts, [params.max_new_tokens] * len(prompts), params, pick)

    @torch.no_grad()
    def replay(self, prompts: list[list[int]], responses: list[list[int]],
               params: SamplingParams, against=None) -> list[torch.Tensor]:
        """Teacher-forced pass through this engine's own sparse path (same KV policy, schedule and
        compressions; in chunks between compressions, ``forced.py``) over given responses. Per
        row: the full next-token log-probs [len(response), V] (float32, host) of the
        distribution sampling would draw from at each step (temperature, top-k, top-p); with
        ``against`` (``.at(rows, steps) -> [R, V]`` log-probs of a reference, e.g.
        ``actors.probes.DenseReference``) only the agreement sum_v min(p, p_ref) per step
        [len(response)]: no rows x length x vocabulary tensor."""
        from correction.metrics import tv_agreement

        kept: list[list[torch.Tensor]] = [[] for _ in prompts]

        def on_chunk(ids, first, logits):
            r, k, v = logits.shape
            out = processed_logprobs(logits.float().view(r * k, v), params.temperature,
                                     params.top_k, params.top_p)
            if against is not None:
                steps = torch.from_numpy(first)[:, None] + torch.arange(k)
                rows = torch.from_numpy(ids)[:, None].expand(-1, k)
                out = tv_agreement(out, against.at(rows.reshape(-1), steps.reshape(-1)))
            out = out.view(r, k, *out.shape[1:]).cpu()
            for j, o in enumerate(ids.tolist()):
                kept[o].append(out[j])

        run_forced(self, prompts, responses, on_chunk, logits=True)
        return [torch.cat(d) for d in kept]

    @torch.no_grad()
    def replay_kept_sets(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list]:
        """Teacher-forced pass over given responses (in chunks, ``forced.py``) that returns, per
        row, the compression events (``GenerationOutput.trace``: what ``common.kept`` turns into
        a visibility mask) this engine's KV policy would produce on them. Needs ``trace=True``.
        What the sampler would keep does not depend on the sampling settings, so there are
        none."""
        if not self.trace:
            raise ValueError("native engine: replay_kept_sets needs an engine built with "
                             "trace=True")
        st = run_forced(self, prompts, responses, lambda *_: None, logits=False)
        return st.trace

    def _run(self, prompts, max_new: list[int], params: SamplingParams, pick) -> list[GenerationOutput]:
        """The decode loop shared by ``generate`` and ``replay``: ``pick(logits, state)`` gives each
        live row's next token and its log-prob; row r ends after ``max_new[r]`` tokens."""
        t0 = time.perf_counter()
        self.dec.refresh()
        dev = self.device = next(self.model.parameters()).device
        longest = max(max_new, default=0)
        st = BatchState(prompts, max_new, dev, self.trace, self._stops(params),
                        params.stop_token_ids)
        if not prompts or longest <= 0:
            return st.outputs(0)
        lmax = max(len(p) for p in prompts)
        pool = self._pool(min(self.batch_size, len(prompts)), self._capacity(lmax, longest))
        rope = self._rope_table(lmax + longest)
        queue, logits = list(range(len(prompts))), None
        while True:
            live = st.live
            if queue and live <= self.batch_size // 2:
                take, queue = queue[:self.batch_size - live], queue[self.batch_size - live:]
                new_logits = self._admit(prompts, take, pool, st)
                logits = new_logits if live == 0 else torch.cat([logits[:live], new_logits])
            if st.live == 0:
                break
            tok, lp = pick(logits, st)
            st.record(pool, tok, lp)
            late = st.resolve()                      # stops among the previous step's tokens
            st.issue_read(tok, late)                 # read while the next step runs
            done = late | st.by_length()
            if done.any():
                st.retire(pool, done)
                if st.live == 0:
                    continue
            full = np.flatnonzero(st.n >= self._limit(st))
            if len(full):
                self._compress(pool, full, st)
            logits = self.stepper(self.dec, pool, rope, st.live, int(st.n.max()),
                                  self.policy == KVPolicy.h2o)
            st.advance()
        bpt = self.kv_bytes_per_token()
        outs = st.outputs(bpt, self._bins_used)
        self.last_stats = {"allocated_kv_bytes": pool.allocated_bytes(),
                           "peak_kv_bytes": st.peak_total * bpt,
                           "tokens": sum(len(o.response_ids) for o in outs),
                           "attended_slots": st.attended / max(1, st.decode_rows),
                           "time_s": time.perf_counter() - t0}
        return outs

    def _pool(self, rows: int, cap: int) -> KVPool:
        """The slot pool of a call. A captured step (CUDA graphs, compile) keeps it for the next
        call of the same shape, so its graphs stay valid; eager calls allocate their own."""
        dec, pol = self.dec, self.policy
        spec = (rows, cap, pol == KVPolicy.h2o,
                self.kv.obs_window if pol in (KVPolicy.snapkv, KVPolicy.rkv) else 0,
                self.device, dec.dtype, dec.n_layers, dec.n_kv, dec.n_heads, dec.head_dim)
        if self._kept_pool is not None and self._kept_pool[0] == spec:
            return self._kept_pool[1]
        self._kept_pool = None              # free the old one first
        pool = KVPool(dec.n_layers, spec[0], dec.n_kv, dec.n_heads, dec.head_dim, cap, dec.dtype,
                      need_acc=spec[2], obs_window=spec[3], device=self.device)
        if self.stepper.resolve(self.device) != "eager":
            self._kept_pool = (spec, pool)
        return pool

    def _rope_table(self, n: int) -> RopeTable:
        """RoPE rows of positions [0, n); kept while long enough (captured graphs read it)."""
        rope = self._rope
        if rope is None or rope.n < n or rope.device != self.device or rope.dec is not self.dec:
            rope = self._rope = RopeTable(self.dec, n, self.device)
        return rope

    def _stops(self, params: SamplingParams) -> StopMatcher | None:
        stops = tuple(params.stop or ())
        if not stops:
            return None
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"native engine: stop strings must be non-empty strings, got {stops!r}")
        if self.decode is None:
            path = getattr(self.model, "name_or_path", "")
            if not path:
                raise ValueError("native engine: stop strings need a tokenizer; pass "
                                 "NativeEngine(..., decode=ids -> text)")
            self.decode = tokenizer_decoder(path)
        return StopMatcher(stops, self.decode)

    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token in every layer of this engine's cache
        (``Engine.kv_bytes_per_token``)."""
        from common.modeling import kv_bytes_per_token

        d = self.dec
        return kv_bytes_per_token(d.n_layers, d.n_kv, d.head_dim, d.dtype)

    def _capacity(self, lmax: int, max_new: int) -> int:
        if self.policy == KVPolicy.dense:
            return lmax + max_new
        return min(max(self.budgets) + self.kv.compress_every, lmax + max_new)

    def _limit(self, st: BatchState) -> np.ndarray:
        """Slots at which each live row compresses before writing its next position: its bin's
        budget plus ``compress_every`` (never for a dense cache); with the adaptive budget
        (``kv.keep_mass``) what it kept at its latest compression (at least ``min_budget``, at
        most the bin's budget) plus ``compress_every``."""
        if self.policy == KVPolicy.dense:
            return np.full_like(st.seen, np.iinfo(np.int64).max)
        budget = self.budget_at(st.seen)
        if self.kv.keep_mass > 0:
            budget = np.minimum(np.maximum(st.kept[st.ids], self.kv.min_budget), budget)
        return budget + self.kv.compress_every

    def _bins_used(self, total: int) -> list[int]:
        """The budget of every bin a sequence of ``total`` tokens reached (dense: none)."""
        if self.policy == KVPolicy.dense:
            return []
        bins = -(-total // self.kv.bin_tokens)
        return self.budget_at(np.arange(bins) * self.kv.bin_tokens).tolist()

    def _groups(self, rows: np.ndarray, position: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Rows (host indices) grouped by the budget in force at ``position`` [len(rows)]."""
        budget = self.budget_at(position)
        return [(int(b), rows[budget == b]) for b in np.unique(budget)]

    def _admit(self, prompts, take: list[int], pool: KVPool, st: BatchState) -> torch.Tensor:
        """Prefill prompts[take] into the free rows after the live ones; returns their first
        next-token logits. A prompt longer than its bin's budget is compressed layer by layer
        (only one layer's full prompt KV exists, in a scratch pool, before it is cut)."""
        dec, dev, b, r0 = self.dec, self.device, len(take), st.live
        lens = np.array([len(prompts[i]) for i in take], dtype=np.int64)
        lmax = int(lens.max())
        tokens = torch.zeros(b, lmax, dtype=torch.long)
        for r, i in enumerate(take):
            tokens[r, :lens[r]] = torch.tensor(prompts[i])
        tokens, lens_d = tokens.to(dev), torch.tensor(lens, device=dev)
        positions = torch.arange(lmax, device=dev).expand(b, lmax)
        valid = positions < lens_d[:, None]
        mask = torch.ones(lmax, lmax, dtype=torch.bool, device=dev).tril()[None] & valid[:, None]
        mask = mask[:, None, None]                                  # [B,1,1,T,S]
        x = dec.embed(tokens)
        cos, sin = dec.rope(x, positions)
        over = np.flatnonzero(lens > self.budget_at(lens))
        groups = [] if self.policy == KVPolicy.dense else self._groups(over, lens[over])
        groups = [(bud, part, torch.tensor(part, device=dev)) for bud, part in groups]
        scratch = None if not groups else KVPool(
            1, b, dec.n_kv, dec.n_heads, dec.head_dim, lmax, dec.dtype,
            need_acc=pool.acc is not None, obs_window=pool.obs_window, device=dev)
        protect = lens_d if self.kv.protect_prompt else None
        need_probs = self.policy == KVPolicy.h2o
        kept = [[] for _ in groups]
        for i in range(dec.n_layers):
            q, k, v = dec.qkv(i, x, cos, sin)
            out, probs = attend(q, k, v, mask, dec.scaling, want_probs=need_probs)
            pos = positions[:, None, :].expand(-1, dec.n_kv, -1)
            acc = None
            if need_probs:                       # padded query rows must not add attention mass
                acc = (probs * valid[:, None, None, :, None]).sum(dim=(2, 3))
            dst, j, at = (pool, i, r0) if scratch is None else (scratch, 0, 0)
            dst.write(j, at, k, v, pos, acc)
            dst.fill_window(j, at, q, lens_d)
            if scratch is not None:
                for g, (budget, part, rows_d) in enumerate(groups):
                    kept[g].append(self._compress_layer(
                        scratch, 0, rows_d, lens_d[rows_d], lens_d[rows_d], budget,
                        None if protect is None else protect[rows_d]))
                pool.copy_rows_from(i, r0, scratch, min(lmax, pool.cap))
            x = dec.finish(i, x, out)
        n = lens.copy()
        for budget, part, _ in groups:
            n[part] = budget
        rows = slice(r0, r0 + b)
        pool.rowid[rows] = torch.tensor(take, device=dev)
        pool.count[rows] = 0
        pool.seen[rows] = lens_d
        pool.n[rows] = torch.tensor(n, device=dev)
        st.admit(np.array(take, dtype=np.int64), n, lens)
        for (budget, part, _), k in zip(groups, kept):
            st.compressed(r0 + part, np.full(len(part), budget), torch.stack(k, dim=1))
        return dec.logits(x[torch.arange(b, device=dev), lens_d - 1])

    def _compress_layer(self, pool: KVPool, i: int, rows, n: torch.Tensor, seen: torch.Tensor,
                        budget: int, protect: torch.Tensor | None) -> torch.Tensor:
        """Cut layer i of the given rows (device indices, or an int m: rows [0, m)) to ``budget``
        slots chosen by the policy: a few batched calls whatever the number of rows or heads.
        Returns the kept absolute positions [R,Hkv,budget]. ``n``, ``seen`` [R]: valid slots and
        tokens processed; ``protect`` [R]: prompt lengths (kept first with
        ``kv.protect_prompt``)."""
        view = policies.layer_view(pool, i, rows, n, seen, self.dec.scaling, protect)
        idx = policies.select(self.policy, self.kv, budget, view)
        rows_d = torch.arange(rows, device=self.device) if isinstance(rows, int) else rows
        pool.gather_rows(i, rows_d, idx)
        return pool.pos[i, :rows, :, :budget] if isinstance(rows, int) else \
            pool.pos[i].index_select(0, rows_d)[:, :, :budget]

    def _compress(self, pool: KVPool, full: np.ndarray, st: BatchState) -> None:
        """Compress the given live rows (host indices) of every layer to their bin's budget (or,
        with ``kv.keep_mass``, to each row's adaptive budget under it)."""
        for budget, part in self._groups(full, st.seen[full]):
            rows = len(part) if len(part) == st.live else torch.tensor(part, device=self.device)
            if isinstance(rows, int):
                n, seen, rowid = pool.n[:rows], pool.seen[:rows], pool.rowid[:rows]
            else:
                n, seen, rowid = pool.n[rows], pool.seen[rows], pool.rowid[rows]
            protect = st.plen_d[rowid] if self.kv.protect_prompt else None
            if self.kv.keep_mass > 0:
                k, k_d, kept = self._compress_adaptive(pool, rows, n, seen, budget, protect)
                if isinstance(rows, int):
                    pool.n[:rows].copy_(k_d)
                else:
                    pool.n.index_copy_(0, rows, k_d)
            else:
                k = np.full(len(part), budget)
                kept = [self._compress_layer(pool, i, rows, n, seen, budget, protect)
                        for i in range(self.dec.n_layers)]
                if isinstance(rows, int):
                    pool.n[:rows].fill_(budget)
                else:
                    pool.n.index_fill_(0, rows, budget)
            st.compressed(part, k, torch.stack(kept, dim=1) if st.trace is not None else None)

    def _compress_adaptive(self, pool: KVPool, rows, n: torch.Tensor, seen: torch.Tensor,
                           budget: int, protect: torch.Tensor | None):
        """``kv.keep_mass``: every layer's scores first, then one budget per row for all layers
        (``policies.mass_budgets``; the compression's one device read), then each layer cut to
        it. Returns the budgets [R] (host and device) and the kept positions per layer
        [R,Hkv,max]."""
        kv, scaling = self.kv, self.dec.scaling
        views = [policies.layer_view(pool, i, rows, n, seen, scaling, protect)
                 for i in range(self.dec.n_layers)]
        orders = [policies.ranking(*policies.score(self.policy, kv, budget, v), n)
                  for v in views]
        curves = [policies.coverage(o, policies.window_mass(v.win)) for o, v in zip(orders, views)]
        lo = min(kv.min_budget, budget)
        if protect is not None:     # the prompt and the window stay whole while they fit
            lo = (protect + kv.obs_window).clamp(min=lo)
        k_d = policies.mass_budgets(curves, n, lo, budget, kv.keep_mass)
        k = np.array(k_d.tolist())          # the one device read of a compression
        width = int(k.max())
        rows_d = torch.arange(rows, device=self.device) if isinstance(rows, int) else rows
        kept = []
        for i, order in enumerate(orders):
            idx = policies.keep_rows(order, k_d, width)
            pool.gather_rows(i, rows_d, idx)
            kept.append(pool.pos[i].index_select(0, rows_d)[:, :, :width])
        return k, k_d, kept
