"""Buffer errors: each names what is wrong and what the caller can do."""
from __future__ import annotations

from common.errors import DataError


class BufferFull(RuntimeError):
    """append() would exceed capacity. Nothing was stored; retry after consumers catch up."""

    def __init__(self, capacity: int, live: int, requested: int):
        self.capacity, self.live, self.requested = capacity, live, requested
        super().__init__(f"replay buffer full: {live} live rows + {requested} requested > "
                         f"capacity {capacity}; nothing was stored, retry later")


class SegmentCorrupt(DataError):
    """A segment file failed its checksum or could not be parsed; it was moved to quarantine/."""

    def __init__(self, path: str, reason: str, moved_to: str | None = None):
        self.moved_to = moved_to
        where = f"; quarantined to {moved_to}" if moved_to else ""
        super().__init__(path, f"corrupt or truncated buffer segment ({reason}){where}")
