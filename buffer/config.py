"""BufferConfig: the `buffer` section of TrainConfig (an OmegaConf structured config)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from common.errors import ConfigError
from common.validate import check_range


class StalePolicy(str, enum.Enum):
    """What happens to a group older than the learner's version minus `max_staleness`."""

    DROP = "drop"          # discard it (counted in stats()["stale_dropped_groups"])
    REQUEUE = "requeue"    # discard it and hand its prompt_idx back via take_requeued()


@dataclass
class PodsConfig:
    """PODS max-variance down-sampling (Xu et al., "Not All Rollouts are Useful").

    Of the n rollouts of a group, keep `keep` (m) with maximal reward variance; groups with
    n <= m are kept whole.
    """

    enabled: bool = False
    keep: int = 4

    def validate(self, prefix: str = "buffer.pods") -> None:
        check_range(f"{prefix}.keep", self.keep, lo=1)


@dataclass
class BufferConfig:
    capacity: int = 4096                  # live (not yet consumed) rows; append beyond -> BufferFull
    max_staleness: int = 1                # policy versions a sample may lag the learner
    stale_policy: StalePolicy = StalePolicy.DROP
    group_size: int = 0                   # >0: a group is ready only with exactly this many rows
    root: Optional[str] = None            # directory for durable segments; None = in memory only
    fsync: bool = True                    # fsync segment files and the directory on every write
    segment_rows: int = 256               # max rows per data segment file (GC granularity)
    scoring_lease_s: float = 600.0        # rows handed to a scorer are re-offered after this
    pods: PodsConfig = field(default_factory=PodsConfig)

    def validate(self, prefix: str = "buffer") -> None:
        check_range(f"{prefix}.capacity", self.capacity, lo=1)
        check_range(f"{prefix}.max_staleness", self.max_staleness, lo=0)
        if not isinstance(self.stale_policy, StalePolicy):
            try:
                self.stale_policy = StalePolicy(self.stale_policy)
            except ValueError:
                raise ConfigError(f"{prefix}.stale_policy", self.stale_policy,
                                  "one of " + ", ".join(repr(p.value) for p in StalePolicy)) from None
        check_range(f"{prefix}.group_size", self.group_size, lo=0)
        check_range(f"{prefix}.segment_rows", self.segment_rows, lo=1)
        check_range(f"{prefix}.scoring_lease_s", self.scoring_lease_s, lo=0, lo_open=True)
        if self.root is not None and not str(self.root).strip():
            raise ConfigError(f"{prefix}.root", self.root, "a directory path or null")
        self.pods.validate(f"{prefix}.pods")
        if self.group_size and self.pods.enabled and self.pods.keep > self.group_size:
            raise ConfigError(f"{prefix}.pods.keep", self.pods.keep,
                              f"at most {prefix}.group_size ({self.group_size})")
