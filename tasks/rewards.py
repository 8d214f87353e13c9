"""Running reward functions so that one that raises or hangs costs a sample, not the run.

``RewardRunner(task_cfg, timeout_s).score([(response, answer), ...])`` returns one
``(reward, fault)`` per pair: ``fault`` is None, ``"timeout"`` (the call ran past ``timeout_s``,
or math-verify's own limit cut it short: ``RewardTimeout``) or ``"error: <Type>: <message>"``; a
faulty sample gets reward 0.0 (decided in docs/INTERFACES.md, "Buffer rows": a group keeps all
its members, so GRPO's statistics stay whole). A NaN returned by the function is passed on as is:
the driver's batch screening skips it (``learner/screen.py``).

With ``timeout_s > 0`` the rewards run in a child process (``python -m tasks.rewards``): a thread
cannot be stopped, and ``signal.alarm`` needs the main thread, which a Ray actor's methods do not
run in. The whole batch goes over in one message and the results stream back one by one, so the
common path costs one round trip per batch; a call that passes its deadline gets the child killed
and restarted, and the rest of the batch is sent again. The child runs the rewards in its main
thread, where math-verify's own signal-based timeouts work. ``timeout_s = 0``: in-process, errors
still caught, no timeout.
"""
from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import time
from pathlib import Path

from tasks.base import RewardTimeout

TIMEOUT = "timeout"
_LEN = struct.Struct("!I")
_EOF = object()


def reward_fn(task_cfg):
    """The reward function of ``task_cfg``: ``task.reward_fn`` ("module:function") when set,
    else the task's own ``reward`` method."""
    from tasks import make_task

    return make_task(task_cfg).reward


def call(fn, response: str, answer: str) -> tuple[float, str | None]:
    """One reward call with its fault, if any (never raises for the function's own errors)."""
    try:
        return float(fn(response, answer)), None
    except RewardTimeout:
        return 0.0, TIMEOUT
    except Exception as err:  # any error of a user's reward function is a counted fault
        return 0.0, f"error: {type(err).__name__}: {err}"[:300]


def is_error(fault: str | None) -> bool:
    return fault is not None and fault != TIMEOUT


class RewardRunner:
    """See the module docstring. Not thread-safe: one actor, one runner."""

    def __init__(self, task_cfg, timeout_s: float, fn=None):
        """``fn``: a reward function object to call in-process instead (no timeout)."""
        self.task_cfg, self.timeout_s = task_cfg, float(timeout_s)
        self._fn = fn if fn is not None else reward_fn(task_cfg) if self.timeout_s <= 0 else None
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self.restarts = 0   # children killed (timeouts) or lost (crashes) and started again

    def score(self, pairs: list[tuple[str, str]]) -> list[tuple[float, str | None]]:
        if self._fn is not None:
            return [call(self._fn, r, a) for r, a in pairs]
        out: list[tuple[float, str | None]] = []
        while len(out) < len(pairs):
            self._ensure_child()
            self._send(pairs[len(out):])
            for _ in range(len(pairs) - len(out)):
                got = self._recv(time.monotonic() + self.timeout_s)
                if got is None or got is _EOF:  # past its deadline, or the child died
                    out.append((0.0, TIMEOUT if got is None else "error: the reward process "
                                f"died (exit code {self._proc.wait()})"))
                    self._kill()
                    break
                out.append(got)
        return out

    # ---- the child process -----------------------------------------------------------------
    def _ensure_child(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        if self._proc is not None:
            self._kill()
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        self._proc = subprocess.Popen([sys.executable, "-m", "tasks.rewards"], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buf = b""
        self._send(self.task_cfg)

    def _kill(self, restart: bool = True) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self.restarts += int(restart)
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            f.close()

    def _send(self, obj) -> None:
        data = pickle.dumps(obj)
        try:
            self._proc.stdin.write(_LEN.pack(len(data)) + data)
            self._proc.stdin.flush()
        except BrokenPipeError:  # died: the next _recv sees EOF and counts it
            pass

    def _recv(self, deadline: float):
        """One frame from the child; None at the deadline, ``_EOF`` when it died."""
        fd = self._proc.stdout.fileno()
        while True:
            if len(self._buf) >= _LEN.size:
                (n,) = _LEN.unpack_from(self._buf)
                if len(self._buf) >= _LEN.size + n:
                    frame = self._buf[_LEN.size:_LEN.size + n]
                    self._buf = self._buf[_LEN.size + n:]
                    return pickle.loads(frame)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return _EOF
            self._buf += chunk

    def close(self) -> None:
        self._kill(restart=False)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the child dies with its pipes anyway
            pass


def _read(f):
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    return pickle.loads(f.read(_LEN.unpack(head)[0]))


def main() -> None:
    """The child: the task config, then batches of (response, answer); one frame per result."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a reward function prints goes to stderr, never into the frames
    src = os.fdopen(0, "rb")
    fn = reward_fn(_read(src))
    while (pairs := _read(src)) is not None:
        for response, answer in pairs:
            data = pickle.dumps(call(fn, response, answer))
            out.write(_LEN.pack(len(data)) + data)
            out.flush()


if __name__ == "__main__":
    main()
