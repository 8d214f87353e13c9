"""Arrow schema of buffer rows (docs/INTERFACES.md, "Buffer rows") and row -> batch conversion.

Two kinds of record batches are stored:
- data rows (`SCHEMA`): one sample each, written once by append(); the scoring columns
  (old/ref log-probs, scorer_version, state) stay at their defaults there;
- state-log rows (`LOG_SCHEMA`): a transition of one sample (scored with its log-probs,
  consumed, dropped, requeued), written by set_scores(), mark_consumed() and staleness control.
"""
from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

LP = pa.list_(pa.float32())
IDS = pa.list_(pa.int32())

SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("prompt_idx", pa.int64(), nullable=False),
    pa.field("prompt_ids", IDS, nullable=False),
    pa.field("response_ids", IDS, nullable=False),
    pa.field("sampler_logprobs", LP, nullable=False),   # len = response_len
    pa.field("old_logprobs", LP),                       # null until scored
    pa.field("ref_logprobs", LP),                       # optional
    pa.field("reward", pa.float32(), nullable=False),
    pa.field("policy_version", pa.int64(), nullable=False),
    pa.field("scorer_version", pa.int64(), nullable=False),  # -1 until scored
    pa.field("kv_policy", pa.string(), nullable=False),
    pa.field("kv_budget", pa.int32(), nullable=False),
    pa.field("kept_ratio", pa.float32(), nullable=False),
    pa.field("prompt_len", pa.int32(), nullable=False),
    pa.field("response_len", pa.int32(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("gen_time_s", pa.float32(), nullable=False),
    pa.field("logprob_mode", pa.string(), nullable=False),
    pa.field("state", pa.string(), nullable=False),
    pa.field("created_at", pa.float64(), nullable=False),   # unix time of append (extra)
    # pi_dense^v: dense log-probs under the sampler's own weights (rollout.dense_logprobs), for
    # the staleness split; null when not computed. Last, so older segments are a prefix (upgrade).
    pa.field("dense_sampler_logprobs", LP),
    # most KV bytes the engine stored for this sequence (all layers, K and V); null in segments
    # written before it was recorded
    pa.field("peak_kv_bytes", pa.int64()),
    # why the sample's reward is 0 by default rather than computed: "timeout" or "error: ..."
    # (tasks/rewards.py); null when the reward function answered (or in older segments)
    pa.field("reward_fault", pa.string()),
    # KV budget in force in each position bin the sequence reached (rollout.kv.bin_tokens; null:
    # a dense cache or another engine)
    pa.field("kv_bin_budgets", pa.list_(pa.int32())),
    # exact per-token agreement 1 - TV of the sparse and dense next-token distributions, len =
    # response; probe rows only (rollout.kv.probe_share), null elsewhere
    pa.field("kv_agreement", LP),
    # DistillSparse (rollout.distill_sparse): the sampler's kept sets as eviction points, flat
    # [L * Hkv * (prompt_len + response_len)] (common/kept.evictions); null otherwise
    pa.field("kv_evictions", IDS),
])

LOG_SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("state", pa.string(), nullable=False),
    pa.field("old_logprobs", LP),
    pa.field("ref_logprobs", LP),
    pa.field("scorer_version", pa.int64(), nullable=False),
])


class State(enum.IntEnum):
    """Lifecycle; a sample only moves to a larger value (recovery replays with max())."""

    GENERATED = 0
    SCORED = 1
    REQUEUED = 2   # stale, waiting for the driver to take its prompt_idx (take_requeued)
    CONSUMED = 3   # trained on (terminal)
    DROPPED = 4    # stale, PODS-discarded or requeue taken (terminal)

    @property
    def label(self) -> str:
        return self.name.lower()


STATE_BY_LABEL = {s.label: s for s in State}

REQUIRED = ("group_id", "prompt_idx", "prompt_ids", "response_ids", "sampler_logprobs",
            "reward", "policy_version")
# Descriptive fields a producer may leave out; the defaults describe a dense, unannotated rollout.
DEFAULTS = {"kv_policy": "dense", "kv_budget": 0, "kept_ratio": 1.0, "finish_reason": "",
            "gen_time_s": 0.0, "logprob_mode": "processed", "scorer_version": -1}
DERIVED = ("sample_id", "prompt_len", "response_len", "state", "created_at",
           "old_logprobs", "ref_logprobs")


def rows_to_batch(rows: Sequence[Mapping]) -> pa.RecordBatch:
    """Build a SCHEMA batch from rollout dicts (one column at a time, converted in C by pyarrow)."""
    if not rows:
        return pa.RecordBatch.from_pylist([], schema=SCHEMA)
    keys = set().union(*(r.keys() for r in rows))
    unknown = keys - set(SCHEMA.names)
    if unknown:
        raise ValueError(f"buffer rows: unknown keys {sorted(unknown)}; allowed: {SCHEMA.names}")
    cols = {}
    for name in SCHEMA.names:
        f = SCHEMA.field(name)
        if name in keys:
            try:
                cols[name] = pa.array([r.get(name) for r in rows], type=f.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
                raise ValueError(f"buffer rows: column '{name}' is not {f.type}: {e}") from e
    return normalize_batch(pa.RecordBatch.from_pydict(cols))


def normalize_batch(batch: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
    """Cast to SCHEMA, fill derived/defaulted columns, check required ones and list lengths."""
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else \
            pa.RecordBatch.from_pylist([], schema=SCHEMA)
    n = batch.num_rows
    have = set(batch.schema.names)
    unknown = have - set(SCHEMA.names)
    if unknown:
        raise ValueError(f"buffer rows: unknown columns {sorted(unknown)}; allowed: {SCHEMA.names}")
    missing = [k for k in REQUIRED if k not in have or batch.column(k).null_count]
    if missing:
        raise ValueError(f"buffer rows: required keys missing or null: {missing}")
    cols = []
    for f in SCHEMA:
        arr = batch.column(f.name) if f.name in have else None
        if arr is not None and arr.null_count and f.name in DEFAULTS:
            arr = pc.fill_null(arr.cast(f.type), DEFAULTS[f.name])
        if arr is None or (arr.null_count == n and f.name in DERIVED and n):
            arr = _default_column(f, batch, n)
        elif arr.null_count and f.name in DERIVED and not f.nullable:
            # Partly given (e.g. some rows without sample_id): derive the missing entries only.
            arr = pc.if_else(pc.is_null(arr), _default_column(f, batch, n).cast(f.type),
                             arr.cast(f.type))
        cols.append(arr.cast(f.type))
    out = pa.RecordBatch.from_arrays(cols, schema=SCHEMA)
    _check_lengths(out)
    return out


def _default_column(f: pa.Field, batch: pa.RecordBatch, n: int) -> pa.Array:
    if f.name == "sample_id":
        return pa.array([uuid.uuid4().hex for _ in range(n)], pa.string())
    if f.name == "prompt_len":
        return pc.list_value_length(batch.column("prompt_ids"))
    if f.name == "response_len":
        return pc.list_value_length(batch.column("response_ids"))
    if f.name == "state":
        return pa.array([State.GENERATED.label] * n, pa.string())
    if f.name == "created_at":
        return pa.array([time.time()] * n, pa.float64())
    if f.name in DEFAULTS:
        return pa.array([DEFAULTS[f.name]] * n, f.type)
    return pa.nulls(n, f.type)


def _check_lengths(b: pa.RecordBatch) -> None:
    """prompt_len/response_len must match the lists; log-prob lists must match the response."""
    resp = pc.list_value_length(b.column("response_ids")).cast(pa.int32())
    checks = [("prompt_len", pc.list_value_length(b.column("prompt_ids")).cast(pa.int32()),
               b.column("prompt_len")),
              ("response_len", resp, b.column("response_len")),
              ("sampler_logprobs", pc.list_value_length(b.column("sampler_logprobs")), resp)]
    for col in ("old_logprobs", "ref_logprobs", "dense_sampler_logprobs"):
        if b.column(col).null_count < b.num_rows:
            checks.append((col, pc.list_value_length(b.column(col)), resp))
    ev = b.column("kv_evictions")
    if ev.null_count < b.num_rows:   # a whole number of (layer, head) rows over the sequence
        seq = pc.add(resp, b.column("prompt_len").cast(pa.int32())).cast(pa.int64())
        n = pc.list_value_length(ev).cast(pa.int64())
        checks.append(("kv_evictions", pc.multiply(pc.divide(n, seq), seq), n.cast(pa.int32())))
    for name, got, want in checks:
        bad = pc.fill_null(pc.not_equal(got.cast(pa.int32()), want), False)
        if pc.any(bad).as_py():
            ids = pc.filter(b.column("sample_id"), bad).to_pylist()[:5]
            raise ValueError(f"buffer rows: '{name}' length disagrees with the token lists "
                             f"for sample_ids {ids}")


def upgrade(batch: pa.RecordBatch, schema: pa.Schema = SCHEMA) -> pa.RecordBatch | None:
    """A stored batch in ``schema`` if it is one written before nullable columns were added
    (its fields are ``schema``'s, in order, minus some nullable ones: those become nulls);
    None if it differs in any other way. Keeps old buffer segments readable."""
    if batch.schema.equals(schema):
        return batch
    have = {f.name: f for f in batch.schema}
    if list(have) != [n for n in schema.names if n in have]:
        return None
    cols = []
    for f in schema:
        if f.name in have:
            if not have[f.name].equals(f):
                return None
            cols.append(batch.column(f.name))
        elif f.nullable:
            cols.append(pa.nulls(batch.num_rows, f.type))
        else:
            return None
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def log_batch(sample_ids: Sequence[str], state: State | Sequence[State], old_logprobs=None,
              ref_logprobs=None, scorer_version: int | Sequence[int] = -1) -> pa.RecordBatch:
    """A LOG_SCHEMA batch recording one transition per sample id (`state` scalar or per id)."""
    n = len(sample_ids)
    states = [state.label] * n if isinstance(state, State) else [s.label for s in state]
    sv = [int(scorer_version)] * n if isinstance(scorer_version, (int, np.integer)) \
        else list(scorer_version)
    if len(states) != n or len(sv) != n:
        raise ValueError(f"log batch: {n} sample ids but {len(states)} states, {len(sv)} versions")
    return pa.RecordBatch.from_arrays([
        pa.array(list(sample_ids), pa.string()),
        pa.array(states, pa.string()),
        _lp_array(old_logprobs, n), _lp_array(ref_logprobs, n),
        pa.array(sv, pa.int64()),
    ], schema=LOG_SCHEMA)


def _lp_array(values, n: int) -> pa.Array:
    """Nullable list<float32> array of n log-prob lists (python lists, numpy arrays or Arrow)."""
    if values is None:
        return pa.nulls(n, LP)
    try:
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        arr = values.cast(LP) if isinstance(values, pa.Array) else pa.array(values, type=LP)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
        raise ValueError(f"log-probs must be lists of floats: {e}") from e
    if len(arr) != n:
        raise ValueError(f"got {len(arr)} log-prob lists for {n} sample ids")
    return arr
