"""How ``python launch/train.py`` ends: its exit code and the one line a user reads.

0: the run finished, or ``--help`` printed the usage and every config key; 2: bad input (a config
key, file or value), one ``error:`` line and no traceback; 3: a training fault (poisoned batches in
a row, non-finite weights), named; 1: a lost buffer that cannot be re-created, naming the
``resume=`` to run; 143 (128 + SIGTERM): stopped after writing its checkpoint.
"""
from __future__ import annotations

import sys
from typing import Callable


def exit_code(main: Callable[[list[str]], dict], argv: list[str], doc: str | None) -> int:
    """Runs ``main(argv)`` (or prints the usage) and maps how it ended to the exit code above."""
    from common.errors import ConfigError, DataError, TrainingFault
    from launch.recovery import BufferLost

    if {"-h", "--help"} & set(argv):  # usage + every key, from the config dataclasses
        from launch.helptext import usage
        print(usage(doc))
        return 0
    try:
        return 143 if main(argv).get("stopped") else 0
    except (ConfigError, DataError) as err:  # bad input: one clear line, no traceback
        return _error(err, 2)
    except TrainingFault as err:
        return _error(err, 3)
    except BufferLost as err:
        return _error(err, 1)


def _error(err: Exception, code: int) -> int:
    print(f"error: {err}", file=sys.stderr)
    return code
