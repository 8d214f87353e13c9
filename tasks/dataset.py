"""Prompt/answer datasets from JSONL or Parquet files, scored with the math verifier.

JSONL is read as bytes and parsed line by line with ``json`` so that a malformed row (bad UTF-8
or bad JSON) names its exact line and column; Parquet is
read through ``pyarrow.parquet`` and a row's "line" is its 1-based row number. A malformed row (bad
JSON, not an object, missing or empty field, GSM8K solution without ``#### N``) raises DataError
naming file and line, or is skipped and counted when ``skip_malformed`` is set.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from common.errors import DataError
from tasks.base import Problem
from tasks.config import AnswerFormat, DataFormat, TaskConfig
from tasks.verify import gsm8k_answer, math_reward


def detect_format(path: Path, fmt: DataFormat) -> DataFormat:
    """The file format: ``fmt`` unless auto, then from the suffix."""
    if fmt is not DataFormat.auto:
        return fmt
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return DataFormat.jsonl
    if suffix in (".parquet", ".pq"):
        return DataFormat.parquet
    raise DataError(str(path), f"cannot tell the format from suffix {suffix!r}; set task.format")


def iter_rows(path: Path, fmt: DataFormat) -> Iterator[tuple[int, object]]:
    """Yield (line, row) pairs; a row that is not valid JSON is yielded as a DataError to raise."""
    if fmt is DataFormat.parquet:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for a broken file
            raise DataError(str(path), f"cannot read Parquet: {e}") from e
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row
        return
    # Bytes, decoded line by line: invalid UTF-8 is then one malformed row (file:line, skippable)
    # instead of an exception out of the file iterator that ends the whole file.
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad = f"byte {raw[e.start]:#04x} at byte column {e.start + 1}"
                yield i, DataError(str(path), f"invalid UTF-8 ({bad})", i)
                continue
            line = line.rstrip("\r\n")  # a kept newline would move JSON's column past the line
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) carry no row
            try:
                yield i, json.loads(line)
            except (ValueError, RecursionError) as e:  # also: nested too deeply, huge integers
                why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) \
                    else str(e) or type(e).__name__
                yield i, DataError(str(path), f"invalid JSON ({why})", i)


def parse_row(row: object, cfg: TaskConfig, path: Path, line: int) -> tuple[str, str]:
    """(prompt, gold answer) of one row, or DataError naming what is wrong with it."""
    if isinstance(row, DataError):
        raise row
    if not isinstance(row, dict):
        raise DataError(str(path), f"row is a {type(row).__name__}, expected an object", line)
    values = []
    for field in (cfg.prompt_field, cfg.answer_field):
        if field not in row:
            raise DataError(str(path), f"missing field {field!r} (fields: {sorted(row)})", line)
        v = row[field]
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise DataError(str(path), f"field {field!r} is {type(v).__name__}, expected text", line)
        v = str(v)
        if not v.strip():
            raise DataError(str(path), f"field {field!r} is empty", line)
        values.append(v)
    # the prompt keeps its whitespace: a chat-formatted one ends with the assistant turn's newline
    prompt, answer = values[0], values[1].strip()
    if cfg.answer_format is AnswerFormat.gsm8k:
        extracted = gsm8k_answer(answer)
        if extracted is None:
            raise DataError(str(path), f"field {cfg.answer_field!r} has no '#### N' final answer", line)
        answer = extracted
    return cfg.prompt_template.replace("{prompt}", prompt), answer


class DatasetTask:
    """A Task over a prompt/answer file; rewards come from ``tasks.verify.math_reward``."""

    name = "dataset"

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self.n_skipped = 0                    # malformed rows skipped (skip_malformed=True)
        self.skipped: list[str] = []          # their messages, the first 20
        self._splits: dict[str, list[Problem]] | None = None

    def load_file(self, path: str | Path) -> list[tuple[str, str]]:
        """All (prompt, answer) pairs of a file, in file order."""
        path = Path(path)
        if not path.is_file():
            raise DataError(str(path), "no such file (task.path / task.heldout_path / "
                                       "task.eval_sets)")
        fmt = detect_format(path, self.cfg.format)
        out = []
        for line, row in iter_rows(path, fmt):
            try:
                out.append(parse_row(row, self.cfg, path, line))
            except DataError as e:
                if not self.cfg.skip_malformed:
                    raise
                self.n_skipped += 1
                if len(self.skipped) < 20:
                    self.skipped.append(str(e))
        if not out:
            raise DataError(str(path), "no usable rows")
        return out

    def _load(self) -> dict[str, list[Problem]]:
        cfg = self.cfg
        rows = self.load_file(cfg.path)
        if cfg.heldout_path:
            held = self.load_file(cfg.heldout_path)
            held = held[: cfg.n_heldout] if cfg.n_heldout else held
        else:
            # A seeded shuffle decides the held-out rows, so the split is stable across runs.
            order = list(range(len(rows)))
            random.Random(f"dataset:{cfg.seed}").shuffle(order)
            held_set = set(order[: cfg.n_heldout])
            held = [rows[i] for i in sorted(held_set)]
            rows = [r for i, r in enumerate(rows) if i not in held_set]
        train = rows[: cfg.n_train] if cfg.n_train else rows
        return {split: [Problem(i, p, a) for i, (p, a) in enumerate(items)]
                for split, items in (("train", train), ("heldout", held))}

    def eval_set(self, name: str) -> list[Problem]:
        """The problems of ``task.eval_sets`` entry ``name``: its file read with its own fields,
        answer format and prompt template (this task's file format and malformed-row rule)."""
        import dataclasses

        (es,) = [e for e in self.cfg.eval_sets if e.name == name]
        cfg = dataclasses.replace(self.cfg, prompt_field=es.prompt_field,
                                  answer_field=es.answer_field, answer_format=es.answer_format,
                                  prompt_template=es.prompt_template)
        rows = DatasetTask(cfg).load_file(es.path)
        rows = rows[: es.n] if es.n else rows
        return [Problem(i, p, a) for i, (p, a) in enumerate(rows)]

    def problems(self, split: str) -> list[Problem]:
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        if self._splits is None:
            self._splits = self._load()
        return self._splits[split]

    def reward(self, response: str, answer: str) -> float:
        return math_reward(response, answer)
