"""What a complete run checkpoint folder holds, and how ``resume=`` finds one.

Read by ``launch.checkpoint`` (which writes and restores checkpoints) and by ``launch.recovery``
(whose stop message names the newest one), so neither imports the other for it. The layout is
``launch/checkpoint.py``'s module doc.
"""
from __future__ import annotations

import glob
import re
from pathlib import Path

from common.errors import ConfigError

STATE_FILE = "trainer_state.json"
CKPT_NAME = re.compile(r"step-\d+")


# What a complete checkpoint holds: the learners' parts (DeepSpeed's ``latest`` names the tag
# every rank saved under; the HF model) and the driver's (buffer segments, state, config).
PARTS = ("deepspeed/latest", "hf/config.json", "buffer", STATE_FILE, "config.yaml")


def missing_parts(ckpt: Path) -> list[str]:
    """The parts of ``PARTS`` that ``ckpt`` lacks (with the DeepSpeed tag folder ``latest``
    names); empty: complete."""
    missing = [part for part in PARTS if not (ckpt / part).exists()]
    latest = ckpt / "deepspeed" / "latest"
    if latest.is_file() and not (ckpt / "deepspeed" / latest.read_text().strip()).is_dir():
        missing.append(f"deepspeed/{latest.read_text().strip()}")
    return missing


def find_checkpoint(path: str) -> Path:
    """A checkpoint folder as given, or the newest complete one under ``path/checkpoints``.
    A folder with only some of the parts (``PARTS``) is refused, naming what it lacks."""
    p = Path(path)
    if (p / STATE_FILE).is_file():
        missing = missing_parts(p)
        if missing:
            raise ConfigError("resume", path, f"a complete checkpoint; this one lacks {missing} "
                              "(were the learners' parts written on another node? run.out_dir "
                              "must be on storage every node shares)")
        return p
    found = completed(p / "checkpoints") if p.is_dir() else []
    if not found:
        raise ConfigError("resume", path, f"a checkpoint folder (with {', '.join(PARTS)}) or a "
                                          "run folder holding complete checkpoints/step-*")
    return found[-1]


def completed(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first: ``step-NNNNNN`` folders holding
    every part of ``PARTS`` (a ``.partial`` one is still being written, or its run was killed; a
    half one had its learners' parts written on another node)."""
    return sorted(c for c in root.glob("step-*") if c.is_dir() and CKPT_NAME.fullmatch(c.name)
                  and not missing_parts(c))


def latest_checkpoint(out_dir: str, name: str) -> Path | None:
    """The newest complete checkpoint of the newest run folder ``out_dir/<name>-<date>-<time>``
    that has one (a resumed run writes a new folder, so its checkpoints are the newest), or None.

    Run folders sort by their start time (the name's suffix), checkpoints by their step; a folder
    whose run died before its first checkpoint is passed over. Only ``<name>-<8 digits>-<6 digits>``
    counts, so run ``a`` never picks up run ``a-b``'s folders.
    """
    root = Path(out_dir)
    stamp = re.compile(re.escape(name) + r"-\d{8}-\d{6}")
    runs = sorted((d for d in root.glob(f"{glob.escape(name)}-*")
                   if d.is_dir() and stamp.fullmatch(d.name)), reverse=True) if root.is_dir() else []
    for run in runs:
        done = completed(run / "checkpoints")
        if done:
            return done[-1]
    return None
