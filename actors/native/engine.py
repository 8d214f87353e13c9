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
   ``GenerationOutput.bin_budgets`` records the budget of every bin a sequence reached. Rows that emit a stop token or reach
   ``max_new_tokens`` leave the batch at once (the cache rows are dropped). Stop strings
   (``SamplingParams.stop``) are matched by decoding each row's tail (``stops.py``): the token that
   completes one ends the row like a stop token (kept, finish_reason "stop").
3. Continuous batching: at most ``batch_size`` rows decode together; once half of them have left,
   waiting prompts are prefilled (step 1) and their rows are appended to the running batch.

Log-probs are those of the distribution each token was sampled from (``sampling.py``). Memory: the
preallocated cache holds ``rows * cap`` tokens, cap = ``budget + compress_every`` (sparse) or
``longest prompt + max_new_tokens`` (dense); ``GenerationOutput.peak_kv_bytes`` is the most tokens a
sequence had stored (all layers, K and V); ``last_stats`` has the batch's ``allocated_kv_bytes``
(max over the call), ``peak_kv_bytes`` (most tokens stored at once by all live rows) and
``attended_slots`` (KV slots a decode step reads per row, on average: what attention costs).
Transient extras not counted there: one layer's full prompt KV while a long prompt is compressed at
prefill, and both the old and new row sets for the moment of a refill's concatenation.
Dtype: the model's (``rollout.dtype``); the cache is stored in it. In bf16 the logits are cast to
float32 before sampling, so log-probs are float32 everywhere, and attention keeps its softmax in
float32 (on the CPU its scores too: ``model.cpu_low_precision``).
Sampling: one ``torch.Generator`` seeded from ``SamplingParams.seed`` per call, so the same prompts,
seed and ``batch_size`` give the same samples. ``replay`` runs the same loop teacher-forced over
given responses and returns each step's full next-token log-probs (probes, ``actors/probes.py``).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch

from actors.config import KVConfig, KVPolicy
from actors.engine import GenerationOutput, SamplingParams
from actors.native import policies
from actors.native.kvcache import KVStore
from actors.native.model import Decoder, RopeTable, attend, decode_attend
from actors.native.sampling import sample, truncate
from actors.native.stops import StopMatcher, tokenizer_decoder


class NativeEngine:
    def __init__(self, model, kv: KVConfig | None = None, batch_size: int = 64, trace: bool = False,
                 decode: Callable[[list[int]], str] | None = None):
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

    @classmethod
    def from_config(cls, cfg, model_path: str) -> "NativeEngine":
        """Load the model (on the GPU when the process has one, else the CPU) for ``cfg``."""
        from common.modeling import load_model

        from common.dtypes import torch_dtype

        model = load_model(model_path, dtype=torch_dtype(cfg.dtype))
        if torch.cuda.is_available():
            model = model.to("cuda")
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

    def budget_at(self, position: torch.Tensor) -> torch.Tensor:
        """Budget in force for rows about to write ``position`` [R] (host): its bin's budget, the
        last bin's beyond the schedule."""
        table = torch.tensor(self.budgets, dtype=torch.long)
        return table[(position // self.kv.bin_tokens).clamp(max=len(self.budgets) - 1)]

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
        """Teacher-forced pass through this engine's own decode path (same KV policy, schedule and
        compressions) over given responses. Per row: the full next-token log-probs
        [len(response), V] (float32, host) of the distribution sampling would draw from at each
        step (temperature, top-k, top-p); with ``against`` (``.at(rows, steps) -> [R, V]``
        log-probs of a reference, e.g. ``actors.probes.DenseReference``) only the agreement
        sum_v min(p, p_ref) per step [len(response)]: no rows x length x vocabulary tensor."""
        from correction.metrics import tv_agreement

        if any(len(r) == 0 for r in responses):
            raise ValueError("native engine: replay needs a non-empty response per row")
        forced = [torch.tensor(r, dtype=torch.long) for r in responses]
        kept: list[list[torch.Tensor]] = [[] for _ in prompts]

        def pick(logits, st):
            scaled = logits.float() / (params.temperature or 1.0)
            logp = torch.log_softmax(truncate(scaled, params.top_k, params.top_p)
                                     if params.temperature else scaled, dim=-1)
            ids, steps = st.ids.tolist(), st.count[st.ids]
            tok = torch.stack([forced[o][int(c)] for o, c in zip(ids, steps)]).to(logits.device)
            out = logp if against is None else tv_agreement(logp, against.at(st.ids, steps))
            for j, o in enumerate(ids):
                kept[o].append(out[j].cpu())
            return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

        no_stop = replace(params, stop_token_ids=(), stop=())
        self._run(prompts, [len(r) for r in responses], no_stop, pick)
        return [torch.stack(d) for d in kept]

    def _run(self, prompts, max_new: list[int], params: SamplingParams, pick) -> list[GenerationOutput]:
        """The decode loop shared by ``generate`` and ``replay``: ``pick(logits, state)`` gives each
        live row's next token and its log-prob; row r ends after ``max_new[r]`` tokens."""
        t0 = time.perf_counter()
        self.dec.refresh()
        dev = self.device = next(self.model.parameters()).device
        longest = max(max_new, default=0)
        st = _BatchState(prompts, max_new, dev, self.trace, self._stops(params))
        if not prompts or longest <= 0:
            return st.outputs(0)
        cap = self._capacity(max(len(p) for p in prompts), longest)
        rope = RopeTable(self.dec, max(len(p) for p in prompts) + longest, dev)
        stop = torch.tensor(sorted(set(int(t) for t in params.stop_token_ids)), dtype=torch.long,
                            device=dev)
        queue = list(range(len(prompts)))
        store, logits, seen, allocated = None, None, None, 0
        while True:
            live = 0 if store is None else len(st.ids)
            if queue and live <= self.batch_size // 2:
                take, queue = queue[:self.batch_size - live], queue[self.batch_size - live:]
                new, new_logits, lens = self._admit(prompts, take, cap, st)
                if store is None:
                    store, logits, seen = new, new_logits, lens
                else:
                    store.extend(new)
                    logits, seen = torch.cat([logits, new_logits]), torch.cat([seen, lens])
                allocated = max(allocated, store.allocated_bytes())
            if store is None:
                break
            tok, lp = pick(logits, st)
            alive = st.record(tok, lp, stop)
            if not bool(alive.all()):
                rows = alive.nonzero().squeeze(-1)
                st.keep_rows(rows)
                if rows.numel() == 0:
                    store = None
                    continue
                store.keep_rows(rows)
                tok, seen = tok[rows.to(dev)], seen[rows]
            full = (store.n >= self._limit(seen)).nonzero().squeeze(-1)
            if full.numel():
                self._compress(store, full, seen, st)
            logits = self._decode_step(tok, seen, store, rope)
            st.account(st.ids, store.n, seen + 1)
            seen = seen + 1
        outs = st.outputs(self.bytes_per_token, self._bins_used)
        self.last_stats = {"allocated_kv_bytes": allocated, "peak_kv_bytes": st.peak_total,
                           "tokens": sum(len(o.response_ids) for o in outs),
                           "attended_slots": st.attended / max(1, st.decode_rows),
                           "time_s": time.perf_counter() - t0}
        return outs

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

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token in every layer."""
        d = self.dec
        return 2 * d.n_layers * d.n_kv * d.head_dim * torch.finfo(d.dtype).bits // 8

    def _capacity(self, lmax: int, max_new: int) -> int:
        if self.policy == KVPolicy.dense:
            return lmax + max_new
        return min(max(self.budgets) + self.kv.compress_every, lmax + max_new)

    def _limit(self, seen: torch.Tensor) -> torch.Tensor:
        """Slots at which each row compresses before writing position ``seen``: its bin's budget
        plus ``compress_every`` (never for a dense cache)."""
        if self.policy == KVPolicy.dense:
            return torch.full_like(seen, torch.iinfo(torch.long).max)
        return self.budget_at(seen) + self.kv.compress_every

    def _bins_used(self, total: int) -> list[int]:
        """The budget of every bin a sequence of ``total`` tokens reached (dense: none)."""
        if self.policy == KVPolicy.dense:
            return []
        bins = -(-total // self.kv.bin_tokens)
        return self.budget_at(torch.arange(bins) * self.kv.bin_tokens).tolist()

    def _groups(self, rows: torch.Tensor, position: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Rows (host indices) grouped by the budget in force at ``position`` [len(rows)]."""
        budget = self.budget_at(position)
        return [(int(b), rows[budget == b]) for b in budget.unique().tolist()]

    def _admit(self, prompts, take: list[int], cap: int, st):
        """Prefill prompts[take] into a new store; returns (store, next-token logits, lens)."""
        dec = self.dec
        store = KVStore(dec.n_layers, len(take), dec.n_kv, dec.n_heads, dec.head_dim, cap,
                        dec.dtype, need_acc=self.policy == KVPolicy.h2o,
                        obs_window=self.kv.obs_window if self.policy in (KVPolicy.snapkv,
                                                                         KVPolicy.rkv) else 0,
                        device=self.device)
        ids = torch.tensor(take, dtype=torch.long)
        st.admit(ids)
        batch = [prompts[i] for i in take]
        lens = torch.tensor([len(p) for p in batch])
        return store, self._prefill(batch, lens, store, st, ids), lens.clone()

    def _prefill(self, prompts, lens: torch.Tensor, store: KVStore, st, ids) -> torch.Tensor:
        dec, b, lmax, dev = self.dec, len(prompts), int(lens.max()), self.device
        tokens = torch.zeros(b, lmax, dtype=torch.long)
        for r, p in enumerate(prompts):
            tokens[r, :len(p)] = torch.tensor(p)
        tokens, lens_d = tokens.to(dev), lens.to(dev)
        positions = torch.arange(lmax, device=dev).expand(b, lmax)
        valid = positions < lens_d[:, None]
        mask = torch.ones(lmax, lmax, dtype=torch.bool, device=dev).tril()[None] & valid[:, None]
        mask = mask[:, None, None]                                  # [B,1,1,T,S]
        x = dec.embed(tokens)
        cos, sin = dec.rope(x, positions)
        rows = (lens > self.budget_at(lens)).nonzero().squeeze(-1)
        if self.policy == KVPolicy.dense:
            rows = rows[:0]
        groups = self._groups(rows, lens[rows])   # rows over their bin's budget, by budget
        need_probs = self.policy == KVPolicy.h2o
        kept = [[] for _ in groups]
        for i in range(dec.n_layers):
            q, k, v = dec.qkv(i, x, cos, sin)
            out, probs = attend(q, k, v, mask, dec.scaling, want_probs=need_probs)
            pos = positions[:, None, :].expand(-1, dec.n_kv, -1)
            acc = None
            if need_probs:                       # padded query rows must not add attention mass
                acc = (probs * valid[:, None, None, :, None]).sum(dim=(2, 3))
            # A prompt longer than the budget is compressed layer by layer: only this layer's full
            # prompt KV exists (in `tmp`) before it is cut to the budget.
            dst = store if not rows.numel() else KVStore(
                1, b, dec.n_kv, dec.n_heads, dec.head_dim, lmax, dec.dtype,
                need_acc=store.acc is not None, obs_window=store.obs_window, device=dev)
            j = i if dst is store else 0
            dst.write(j, k, v, pos, acc)
            dst.fill_window(j, q, lens)
            if dst is not store:
                dst.n = lens.clone()
                for g, (budget, part) in enumerate(groups):
                    kept[g].append(self._compress_layer(dst, 0, part, lens[part], budget,
                                                        st.plen(ids[part])))
                store.copy_layer_from(i, dst, 0, min(lmax, store.cap))
            x = dec.finish(i, x, out)
        store.n = lens.clone()
        for (budget, part), k in zip(groups, kept):
            store.n[part] = budget
            st.compressed(ids[part], lens[part] - 1, torch.stack(k, dim=1))
        st.account(ids, store.n, lens, first=True)
        return dec.logits(x[torch.arange(b, device=dev), lens_d - 1])

    def _decode_step(self, tok: torch.Tensor, seen: torch.Tensor, store: KVStore,
                     rope: RopeTable) -> torch.Tensor:
        """One token per row through every layer. Everything shared by the layers (RoPE rows, the
        additive mask, the cache cells to write) is built once here; each layer then runs a few
        fused kernels (``Decoder.step_qkv``, ``decode_attend``, ``Decoder.step_finish``)."""
        dec, dev = self.dec, self.device
        seen_d, slot = seen.to(dev), store.n.to(dev)
        x = dec.embed(tok)
        cos, sin = rope.at(seen_d)
        n1 = store.n + 1
        s = int(n1.max())
        bias = torch.zeros(slot.shape[0], s, dtype=dec.dtype, device=dev).masked_fill_(
            torch.arange(s, device=dev)[None] > slot[:, None], float("-inf"))
        bias = bias.repeat_interleave(dec.n_kv, dim=0)[:, None]           # [B*Hkv,1,s]
        index = store.step_index(slot, seen_d)
        want = self.policy == KVPolicy.h2o
        for i in range(dec.n_layers):
            q, k, v = dec.step_qkv(i, x, cos, sin)
            store.append_step(i, k, v, q, index)
            out, probs = decode_attend(q, store.k[i], store.v[i], s, bias, dec.scaling, want)
            if want:
                store.acc[i][:, :, :s] += probs.sum(dim=2)
            x = dec.step_finish(i, x, out)
        store.n = n1
        return dec.step_logits(x)

    def _compress_layer(self, store: KVStore, i: int, rows: torch.Tensor, seen: torch.Tensor,
                        budget: int, plen: torch.Tensor) -> torch.Tensor:
        """Cut layer i of the given rows (host indices) to ``budget`` slots chosen by the policy;
        returns the kept absolute positions [R,Hkv,budget]. ``seen`` [R]: tokens processed;
        ``plen`` [R]: prompt lengths (kept first with ``kv.protect_prompt``)."""
        rows_d = rows.to(self.device)
        protect = plen.to(self.device) if self.kv.protect_prompt else None
        view = policies.layer_view(store, i, rows_d, seen.to(self.device), self.dec, protect)
        idx = policies.select(self.policy, self.kv, budget, view)
        store.gather_rows(i, rows_d, idx)
        return store.pos[i][rows_d, :, :budget]

    def _compress(self, store: KVStore, rows: torch.Tensor, seen: torch.Tensor, st) -> None:
        """Compress the given rows of every layer to their bin's budget (decode time)."""
        for budget, part in self._groups(rows, seen[rows]):
            plen = st.plen(st.ids[part])
            kept = [self._compress_layer(store, i, part, seen[part], budget, plen)
                    for i in range(self.dec.n_layers)]
            store.n[part] = budget
            st.compressed(st.ids[part], seen[part] - 1, torch.stack(kept, dim=1))


class _BatchState:
    """Per-sequence bookkeeping of one ``generate`` call (indexed by prompt index): tokens and
    log-probs on the device (read back once at the end); counts, kept ratio and peak KV on the host
    (they follow from host-side slot counts). ``ids`` lists the prompt index of each live row."""

    def __init__(self, prompts, max_new: int, device, trace: bool,
                 stops: StopMatcher | None = None):
        self.prompts, self.device, self.stops = prompts, device, stops
        self.max_new = torch.tensor(max_new, dtype=torch.long)   # per row
        self.prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        b, width = len(prompts), max(1, max(max_new, default=1))
        self.ids = torch.zeros(0, dtype=torch.long)
        self.ids_d = self.ids.to(device)
        self.tokens = torch.zeros(b, width, dtype=torch.long, device=device)
        self.logps = torch.zeros(b, width, dtype=torch.float32, device=device)
        self.count = torch.zeros(b, dtype=torch.long)
        self.stopped = torch.zeros(b, dtype=torch.bool, device=device)
        self.kept_sum = torch.zeros(b, dtype=torch.float64)
        self.peak = torch.zeros(b, dtype=torch.long)
        self.peak_total = 0
        self.attended, self.decode_rows = 0, 0    # KV slots read by decode steps, row-steps
        self.trace = [[] for _ in range(b)] if trace else None

    def admit(self, ids: torch.Tensor) -> None:
        self.ids = torch.cat([self.ids, ids])
        self.ids_d = self.ids.to(self.device)

    def record(self, tok, lp, stop: torch.Tensor) -> torch.Tensor:
        """Store one token per live row; returns (host bool) which rows go on."""
        c = self.count[self.ids]
        c_d = c.to(self.device)
        self.tokens[self.ids_d, c_d] = tok
        self.logps[self.ids_d, c_d] = lp.float()
        self.count[self.ids] = c + 1
        is_stop = torch.isin(tok, stop)
        if self.stops is not None:
            hit = self.stops.hits(self.ids.tolist(), tok.tolist())
            is_stop = is_stop | torch.tensor(hit, device=is_stop.device)
        self.stopped[self.ids_d] = is_stop
        return ~is_stop.cpu() & (c + 1 < self.max_new[self.ids])

    def plen(self, ids: torch.Tensor) -> torch.Tensor:
        """Prompt lengths of the given prompt indices (host)."""
        return self.prompt_len[ids]

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.ids = self.ids[rows]
        self.ids_d = self.ids.to(self.device)

    def account(self, ids, n: torch.Tensor, attended_dense: torch.Tensor,
                first: bool = False) -> None:
        """After a forward: row r (prompt ids[r]) attended n[r] keys where dense would attend
        attended_dense[r] (the prefill, which attends the whole prompt, counts as 1)."""
        ratio = torch.ones(len(ids), dtype=torch.float64) if first else \
            n.double() / attended_dense.double()
        self.kept_sum[ids] += ratio
        self.peak[ids] = torch.maximum(self.peak[ids], n)
        if not first:
            total = int(n.sum())
            self.peak_total = max(self.peak_total, total)
            self.attended += total
            self.decode_rows += len(ids)

    def compressed(self, ids, after_pos, kept_pos) -> None:
        if self.trace is not None:
            kept_pos = kept_pos.cpu()
            for j, o in enumerate(ids.tolist()):
                self.trace[o].append((int(after_pos[j]), kept_pos[j]))

    def outputs(self, bytes_per_token: int, bins_used=lambda total: []) -> list[GenerationOutput]:
        tokens, logps = self.tokens.cpu().tolist(), self.logps.cpu().tolist()
        stopped, count = self.stopped.cpu().tolist(), self.count.tolist()
        return [GenerationOutput(
            prompt_ids=list(self.prompts[o]), response_ids=tokens[o][:count[o]],
            logprobs=logps[o][:count[o]], finish_reason="stop" if stopped[o] else "length",
            kept_ratio=float(self.kept_sum[o]) / max(1, count[o]),
            peak_kv_bytes=int(self.peak[o]) * bytes_per_token,
            trace=self.trace[o] if self.trace is not None else [],
            bin_budgets=bins_used(len(self.prompts[o]) + count[o]))
            for o in range(len(self.prompts))]
