"""Append-only, checksummed Arrow IPC segment files written atomically.

Layout of `root`:
    data-<seq>-<crc32>.arrow   rows appended by producers (schema.SCHEMA)
    log-<seq>-<crc32>.arrow    state transitions (schema.LOG_SCHEMA)
    quarantine/                segments that failed to load, moved aside with their name kept
`seq` is one counter shared by both kinds, so sorting by seq replays operations in the order
they happened. The CRC-32 of the file's bytes lives in its name: the name appears only by
rename(2) after the bytes are complete, so a file is either whole and verifiable or absent.
Writes: temp file -> write -> fsync(file) -> rename -> fsync(dir) (fsyncs skipped when
fsync=False, which keeps atomicity against process crashes but not against power loss).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from buffer.errors import SegmentCorrupt

log = logging.getLogger(__name__)
_NAME = re.compile(r"^(data|log)-(\d{12})-([0-9a-f]{8})\.arrow$")


@dataclass
class Segment:
    kind: str      # "data" | "log"
    seq: int
    path: str
    nbytes: int


class SegmentStore:
    def __init__(self, root: str, fsync: bool = True):
        self.root, self.fsync = os.path.abspath(root), fsync
        # False when the folder is new: a buffer re-created on another node, without shared
        # storage, finds nothing where its predecessor wrote (launch/recovery.py checks it)
        self.existed = os.path.isdir(self.root)
        os.makedirs(self.root, exist_ok=True)
        self.files: dict[int, Segment] = {}
        self.quarantined: list[SegmentCorrupt] = []
        self.next_seq = 0

    # ---- writing -------------------------------------------------------------------------
    def write(self, kind: str, batch: pa.RecordBatch) -> int:
        """Durably write `batch` as the next segment; returns its seq."""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, batch.schema) as w:
            w.write_batch(batch)
        data = sink.getvalue()
        seq = self.next_seq
        self.next_seq += 1
        name = f"{kind}-{seq:012d}-{zlib.crc32(data) & 0xffffffff:08x}.arrow"
        path = os.path.join(self.root, name)
        tmp = os.path.join(self.root, f".{name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._sync_dir()
        self.files[seq] = Segment(kind, seq, path, data.size)
        return seq

    def delete(self, seqs: list[int]) -> None:
        """Remove segments; one directory fsync makes the whole set of removals durable."""
        for seq in seqs:
            seg = self.files.pop(seq, None)
            if seg is not None:
                try:
                    os.unlink(seg.path)
                except FileNotFoundError:
                    pass
        if seqs:
            self._sync_dir()

    def _sync_dir(self) -> None:
        if self.fsync:
            fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # ---- reading -------------------------------------------------------------------------
    def scan(self) -> Iterator[tuple[Segment, pa.RecordBatch]]:
        """Yield every valid segment in seq order; quarantine the rest (warning names the file).

        Leftover temp files (a write cut short before its rename) are removed: their operation
        was never acknowledged.
        """
        found = []
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.endswith(".tmp"):
                os.unlink(path)
                continue
            m = _NAME.match(name)
            if m:
                found.append((int(m.group(2)), m.group(1), int(m.group(3), 16), path))
            elif name != "quarantine" and name.endswith(".arrow"):
                self.quarantine(path, "file name is not <kind>-<seq>-<crc32>.arrow")
        for seq, kind, crc, path in sorted(found):
            self.next_seq = max(self.next_seq, seq + 1)
            with open(path, "rb") as f:
                data = f.read()
            if zlib.crc32(data) & 0xffffffff != crc:
                self.quarantine(path, f"CRC-32 mismatch ({len(data)} bytes, truncated or corrupted)")
                continue
            try:
                reader = pa.ipc.open_file(pa.py_buffer(data))
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
                batch = pa.Table.from_batches(batches, reader.schema).combine_chunks()
                batch = batch.to_batches()[0] if batch.num_rows else \
                    pa.RecordBatch.from_pylist([], schema=reader.schema)
            except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
                self.quarantine(path, f"unreadable Arrow IPC: {e}")
                continue
            seg = Segment(kind, seq, path, len(data))
            self.files[seq] = seg
            yield seg, batch

    def quarantine(self, path: str, reason: str) -> None:
        qdir = os.path.join(self.root, "quarantine")
        os.makedirs(qdir, exist_ok=True)
        dest = os.path.join(qdir, os.path.basename(path))
        os.replace(path, dest)
        self._sync_dir()
        err = SegmentCorrupt(path, reason, moved_to=dest)
        self.quarantined.append(err)
        log.error("%s", err)
        warnings.warn(str(err), RuntimeWarning, stacklevel=3)

    # ---- checkpoints ---------------------------------------------------------------------
    def export(self, dest: str) -> int:
        """Copy every segment into the empty directory ``dest``; returns how many. Segments are
        immutable once named, so a hard link is an exact, instant copy (a plain copy across file
        systems)."""
        os.makedirs(dest, exist_ok=True)
        if os.listdir(dest):
            raise ValueError(f"buffer snapshot destination {dest} is not empty")
        for seg in self.files.values():
            _link_or_copy(seg.path, os.path.join(dest, os.path.basename(seg.path)))
        return len(self.files)

    def import_segments(self, src: str) -> int:
        """Copy the segment files of an ``export`` into this (empty) root; ``scan`` then reads
        them. Returns how many."""
        if not os.path.isdir(src):
            raise FileNotFoundError(f"buffer snapshot {src} does not exist")
        names = sorted(n for n in os.listdir(src) if _NAME.match(n))
        for name in names:
            _link_or_copy(os.path.join(src, name), os.path.join(self.root, name))
        self._sync_dir()
        return len(names)

    def disk_bytes(self) -> int:
        return sum(s.nbytes for s in self.files.values())


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or hard links not allowed there
        shutil.copy2(src, dst)
