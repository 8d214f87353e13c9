"""The receiving end of the weight broadcast, shared by the rollout and scorer actors: one mechanism.

Every receiver *stages*: a broadcast lands in a staging copy of the weights (``stage_weights``,
called by the driver in the actor's ``"weights"`` concurrency group, a thread of its own), so it
completes while a rollout or a scoring call is still running on the actor's main thread; the
next ``rollout``/``evaluate``/``score`` swaps the staged copy into the model first, between
batches, never mid-sequence. The driver therefore never waits for a running rollout to finish
before a broadcast completes.

Cost: one extra copy of the weights per actor, in the model's dtype and on its device (for the
vLLM engine, whose parameters live inside vLLM, on the weight-sync group's device: the GPU with
NCCL), allocated at the first broadcast and reused. The swap is one copy of the weights
(``load_weights``); the checksum of the staged copy is computed where it lives
(``common.modeling.abs_sum``: on the GPU for CUDA tensors) and the swap checks the model
against it, so the number the driver compares with the learner's is what the model holds.
"""
from __future__ import annotations

import threading

import torch


def join_weight_sync(old, host: str, port: int, rank: int, world_size: int, spec,
                     timeout_s: float = 300.0):
    """Leave the group ``old`` (None: never joined) and join the one at ``host:port`` as ``rank``
    (a collective with the learner and every other actor). Re-forming happens when an actor
    restarts or a pool is resized. ``timeout_s`` bounds the join and every later receive, so a
    dead peer is an error, not a hang."""
    from cluster.weight_sync import WeightReceiver

    if old is not None:
        old.close()
    return WeightReceiver(host, port, rank, world_size, spec, timeout_s=float(timeout_s))


class StagedWeights:
    """A weight-sync receiver plus the staging copy it receives into (see the module docstring).

    ``template``: name -> tensor giving each weight's shape, dtype and device (the model's
    parameters; tensors on the meta device, like the vLLM engine's HF skeleton, are staged on the
    receiver's device). At most one version is staged: a newer broadcast replaces an unswapped one.
    """

    def __init__(self, receiver, template: dict[str, torch.Tensor]):
        self.receiver = receiver
        self._template = template
        self._lock = threading.Lock()       # a swap waits for a receive in progress
        self._staged: dict[str, torch.Tensor] | None = None
        self.version: int | None = None     # staged, not yet swapped in
        self.checksum: float | None = None
        self.swaps: list[tuple[int, float | None]] = []   # (version, checksum after swap), last 64

    def rejoin(self, receiver) -> None:
        """Use a new receiver (a re-formed group); the staging copy, and a version staged
        through the old group (received whole and checked), stay."""
        self.receiver = receiver

    def close(self) -> None:
        self.receiver.close()

    @torch.no_grad()
    def stage(self, verify: bool = True) -> dict:
        """Receive one broadcast into the staging copy (a collective with the learner's send).
        Returns {"version", "checksum"} (the checksum None unless ``verify``). A failed receive
        leaves nothing staged."""
        from common.modeling import checksum

        with self._lock:
            self.version = self.checksum = None
            version, _ = self.receiver.receive(into=self._dest())
            self.checksum = checksum(self._staged.items()) if verify else None
            self.version = int(version)
            return {"version": self.version, "checksum": self.checksum}

    def _dest(self) -> dict[str, torch.Tensor]:
        if self._staged is None:
            device = self.receiver.device
            self._staged = {n: torch.empty(t.shape, dtype=t.dtype,
                                           device=device if t.is_meta else t.device)
                            for n, t in self._template.items()}
        return self._staged

    def swap(self, load, model_checksum, upto: int | None = None, who: str = "actor") -> bool:
        """Load the staged weights, if any, with ``load(named_tensors, version)``, unless they are
        newer than ``upto`` (a call that must run on the version it was tagged with keeps the
        model it has). With a staged checksum, ``model_checksum()`` must then equal it. Returns
        whether it swapped."""
        with self._lock:
            version, want = self.version, self.checksum
            if version is None or (upto is not None and version > upto):
                return False
            load(list(self._staged.items()), version)
            got = None if want is None else model_checksum()
            if want is not None and got != want:
                raise RuntimeError(f"{who}: after swapping in version {version} the model's "
                                   f"checksum {got} != staged {want}")
            self.version = self.checksum = None
            self.swaps = (self.swaps + [(version, got)])[-64:]
            return True


class ReceivesWeights:
    """The weight-sync methods of an actor (mixin for ``RolloutActor`` and ``ScorerActor``).

    The actor provides ``weight_spec()``, ``_weight_template()`` (name -> tensor to stage like),
    ``load_weights(named, version)``, ``state_checksum()`` and ``_label`` (for messages), and
    calls ``_swap_staged(upto)`` before each batch. ``_receiver`` (a ``StagedWeights``) is None
    until the actor joins a group (``cluster.elastic`` probes it to find restarted actors).
    """

    _receiver: StagedWeights | None = None

    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int,
                         timeout_s: float = 300.0) -> None:
        """Join (or re-join) the weight-sync group as ``rank``."""
        old, self._receiver = self._receiver, None  # a failed join must not leave a closed one
        receiver = join_weight_sync(old.receiver if old else None, host, port, rank, world_size,
                                    self.weight_spec(), timeout_s)
        if old is not None:
            old.rejoin(receiver)
            self._receiver = old
        else:
            self._receiver = StagedWeights(receiver, self._weight_template())

    def stage_weights(self, verify: bool = True) -> dict:
        """Receive one broadcast into the staging copy, beside a call in progress (the driver
        calls it in the actor's "weights" concurrency group); the next batch swaps it in.
        Returns {"version", "checksum"}: the staged copy's checksum, which the swap checks the
        model against (None unless ``verify``)."""
        if self._receiver is None:
            raise RuntimeError(f"{self._label}: stage_weights called before init_weight_sync")
        return self._receiver.stage(verify)

    def sync_weights(self) -> int:
        """``stage_weights`` and swap at once (the actor is idle); returns the version."""
        staged = self.stage_weights(verify=True)
        self._swap_staged()
        return staged["version"]

    def _swap_staged(self, upto: int | None = None) -> None:
        """Swap in the staged weights (those newer than ``upto`` stay staged); see
        ``StagedWeights.swap``. A receive in progress is waited for: the batch then starts from
        the newer weights, never from older ones."""
        if self._receiver is not None:
            self._receiver.swap(self.load_weights, self.state_checksum, upto, self._label)

    @property
    def swaps(self) -> list[tuple[int, float | None]]:
        """(version, checksum) of the last swaps, oldest first."""
        return [] if self._receiver is None else list(self._receiver.swaps)
