"""Errors that name what is wrong: the key, file or value, and what would be allowed."""
from __future__ import annotations


class ConfigError(ValueError):
    """A config value is unknown, of the wrong type or out of range.

    The message always names the dotted key, the value given and what is allowed.
    """

    def __init__(self, key: str, value: object, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config key '{key}': got {value!r}; allowed: {allowed}")


class DataError(ValueError):
    """A data file or row is malformed. The message names the file and, where known, the line."""

    def __init__(self, path: str, message: str, line: int | None = None):
        self.path, self.line = path, line
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")


class TrainingFault(RuntimeError):
    """Training cannot go on safely: too many consecutive skipped steps (non-finite inputs, loss
    or gradients), or weights that are no longer finite. The message names the cause."""
