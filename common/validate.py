"""Range and choice checks used by every component's ``validate()``."""
from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from common.errors import ConfigError


def check_range(key: str, value: float, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, hi_open: bool = False) -> None:
    """Raise ConfigError unless lo <= value <= hi (strict where *_open)."""
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or \
          (hi is not None and (value >= hi if hi_open else value > hi))
    if bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise ConfigError(key, value, f"a number in {left}{lo_s}, {hi_s}{right}")


def check_choice(key: str, value: object, choices: Iterable[object]) -> None:
    """Raise ConfigError unless value is one of choices."""
    choices = list(choices)
    if value not in choices:
        raise ConfigError(key, value, "one of " + ", ".join(repr(c) for c in choices))


def check_enum(key: str, cls: type[Enum], value: object) -> Enum:
    """Coerce ``value`` (an Enum member or its string value) to ``cls``, or raise ConfigError naming
    ``key`` and listing the allowed values."""
    try:
        return cls(value.value if isinstance(value, Enum) else value)
    except ValueError:
        raise ConfigError(key, value, "one of " + ", ".join(repr(m.value) for m in cls)) from None
