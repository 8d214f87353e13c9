"""Same-machine weight transport: a two-slot ring in a shared-memory file, paced by barriers.

Over loopback TCP a byte is copied into the kernel by the sender and out again by the receiver,
with TCP's bookkeeping on top: on the 2-core dev machine a 50 MB gloo broadcast takes ~2.5-3.5x a
plain copy of the same bytes. When every receiver runs on the sender's machine, the sender copies
each chunk once into shared memory while the receivers copy the previous chunk out of the other
slot, so the transfer costs about one copy per side, overlapped, plus one small barrier per chunk.

Used by ``cluster.weight_sync`` (gloo groups only): the sender creates the file and publishes its
path and a random token; a receiver that can map the file and read the token back is on the same
machine (sharing /dev/shm); only if every receiver can, the group uses the ring. The sender unlinks
the file once every receiver has mapped it, so nothing is left behind if a process dies later.
"""
from __future__ import annotations

import bisect
import os
import secrets
from typing import Callable

import torch

SHM_DIR = "/dev/shm"
_TOKEN_BYTES = 16
_ALIGN = 4096


def slot_bytes_for(total_bytes: int) -> int:
    """Slot size for a message of ``total_bytes``: about 8 chunks, each 1-16 MiB.

    Fewer, larger chunks mean fewer barriers (each a round trip through every rank, slow when the
    cores are busy); more, smaller chunks mean more overlap between writing and reading.
    """
    slot = min(max(total_bytes // 8, 1 << 20), 16 << 20)
    return (slot + _ALIGN - 1) // _ALIGN * _ALIGN


class ShmRing:
    """Two ``slot_bytes`` slots after a token, mapped from ``path`` (created when ``token`` is
    None, else opened and checked against ``token``: ``ValueError`` when they differ)."""

    def __init__(self, path: str, slot_bytes: int, token: str | None = None):
        self.path, self.slot_bytes = path, int(slot_bytes)
        size = _ALIGN + 2 * self.slot_bytes
        if token is None:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                # reserve the pages now: a tmpfs that runs out later (Ray's object store shares
                # /dev/shm) would kill the writer with SIGBUS; here it is an OSError -> TCP
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
            os.close(fd)
        elif os.path.getsize(path) != size:
            raise ValueError(f"{path}: size {os.path.getsize(path)}, expected {size}")
        try:
            self.buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        except BaseException:
            if token is None:  # created here: nobody else knows the name
                self.unlink()
            raise
        if token is None:
            token = secrets.token_hex(_TOKEN_BYTES // 2)
            self.buf[:_TOKEN_BYTES].copy_(torch.frombuffer(bytearray(token.encode()), dtype=torch.uint8))
        elif bytes(self.buf[:_TOKEN_BYTES].tolist()).decode(errors="replace") != token:
            raise ValueError(f"{path}: token differs (another machine's file?)")
        self.token = token
        self.slots = [self.buf[_ALIGN + i * self.slot_bytes:_ALIGN + (i + 1) * self.slot_bytes]
                      for i in range(2)]

    def unlink(self) -> None:
        """Remove the file; every process that mapped it keeps its mapping."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def send(self, segments: list[torch.Tensor], barrier: Callable[[list[int]], list[int]],
             header: list[int]) -> None:
        """Stream the concatenation of ``segments`` (flat uint8 tensors) to every receiver.

        Chunk c goes into slot c % 2, then a barrier (the first carries ``header``) says it is
        there; slot c % 2 is written again only after the next barrier, which every receiver
        enters once it has copied chunk c out. The last barrier: every receiver has everything.
        """
        stream = _Stream(segments)
        for c in range(stream.chunks(self.slot_bytes)):
            lo, hi = c * self.slot_bytes, min(stream.total, (c + 1) * self.slot_bytes)
            stream.copy(lo, hi, self.slots[c % 2][:hi - lo], into_slot=True)
            barrier(header if c == 0 else [0] * len(header))
        barrier([0] * len(header))

    def receive(self, segments: list[torch.Tensor], barrier: Callable[[list[int]], list[int]],
                header_len: int) -> list[int]:
        """The receiving side of ``send`` (same segment sizes); returns the sender's header."""
        stream = _Stream(segments)
        zeros = [0] * header_len
        header = zeros
        for c in range(stream.chunks(self.slot_bytes)):
            got = barrier(zeros)
            header = got if c == 0 else header
            lo, hi = c * self.slot_bytes, min(stream.total, (c + 1) * self.slot_bytes)
            stream.copy(lo, hi, self.slots[c % 2][:hi - lo], into_slot=False)
        barrier(zeros)
        return header


class _Stream:
    """Flat uint8 segments seen as one byte stream, copied to and from slots by byte range."""

    def __init__(self, segments: list[torch.Tensor]):
        self.segments = segments
        self.starts = [0]
        for s in segments:
            self.starts.append(self.starts[-1] + s.numel())
        self.total = self.starts[-1]

    def chunks(self, slot_bytes: int) -> int:
        return max(1, -(-self.total // slot_bytes))

    def copy(self, lo: int, hi: int, slot: torch.Tensor, into_slot: bool) -> None:
        """Copy stream bytes [lo, hi) into ``slot`` (its first hi - lo bytes), or back out."""
        i = bisect.bisect_right(self.starts, lo) - 1
        pos = 0
        while lo < hi:
            if self.segments[i].numel() == 0:
                i += 1
                continue
            seg, start = self.segments[i], self.starts[i]
            end = min(hi, start + seg.numel())
            part, window = seg[lo - start:end - start], slot[pos:pos + end - lo]
            if into_slot:
                window.copy_(part)
            else:
                part.copy_(window)
            pos, lo, i = pos + end - lo, end, i + 1
