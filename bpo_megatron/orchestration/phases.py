"""Who holds the devices between the phases of an RL step, and which weights the engines hold.

Built whole, once the trainer stands beside its engines: the engine group, the trainer group and
the rollout engines' weight sync (a :class:`~bpo_megatron.weight_sync.session.WeightSync`). On
shared devices the engines hand their memory back before the trainer is built
(:func:`hand_devices_to_trainer`). The loop calls :meth:`DevicePhases.rollout` before the engines generate and
:meth:`DevicePhases.train` before the trainer computes; :meth:`DevicePhases.weights_changed` after
every optimizer update.

* **Weights.** The engines are synced at the start of the first rollout phase after the trainer's
  weights changed, so every generation sees the newest weights and a run that generates nothing
  after its last update syncs nothing.
* **Devices** (``cluster.colocate``). Engines that share the trainer's devices get them in turns:
  a rollout phase offloads the trainer (what ``cluster.offload`` chose: parameters and optimizer
  state, or the optimizer state alone, to host memory, the gradient buffers freed) and resumes
  the engines' memory; a train phase releases the engines' memory (weights and KV cache) and
  onloads the trainer. A sync needs both sides' weights on the device: the engines get their
  weights' memory back before it and their KV cache only after the trainer has left. On separate
  devices, or when the plan says trainer and engines fit the devices together
  (``cluster.offload: nothing``), nothing moves.
* **What moved** (:meth:`DevicePhases.take_moves`, added to every step's record): the bytes and
  seconds of the weight pushes, the trainer's offloads and onloads and the engines' memory
  resumes since the last record (:data:`MOVE_KEYS`), each key present, zero when nothing ran.
* **Replacements** (an engine that died or hung in any phase): started while the trainer is off
  the devices (it is offloaded for the moment it takes, if need be), released or resumed to what
  its peers hold, and given the current weights before its next request: at once on devices of
  its own, by a full sync on shared ones (the next rollout phase, or at once during one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# What an engine resumes before a sync: its weights (the rest after the trainer left)
WEIGHTS = ("weights",)
# What engines hold: everything, only their weights (during a colocated sync), nothing
HELD, WEIGHTS_ONLY, RELEASED = "held", "weights", "released"
# What the phases moved, in every step's record (the phase times, time/<phase>_s, hold them among
# other work): the bytes the weight pushes sent and their seconds (a push's own: the engines'
# update sessions, the trainer's export and send), the bytes the trainer offloaded, the seconds of
# its offloads and onloads, and of the engines' memory resumes
MOVE_KEYS = ("sync_bytes", "push_s", "offload_bytes", "offload_s", "onload_s", "resume_s")


def taking_turns(shared: bool, offload: str) -> bool:
    """Whether the devices change hands between phases: engines beside a trainer that offloads
    (with ``cluster.offload=nothing`` both hold them throughout, as engines on devices of their own)."""
    return shared and offload != "nothing"


def hand_devices_to_trainer(engines: Any, *, shared: bool, offload: str = "everything") -> None:
    """Engines that just started (holding their initial weights and caches) on devices they take
    turns at with a trainer not built yet hand that memory back, so the trainer can be built."""
    if taking_turns(shared, offload):
        engines.release_memory()


class DevicePhases:
    """The devices between the trainer and its rollout engines, and which weights the engines
    hold; also the engines' :class:`~bpo_megatron.orchestration.engine_group.Custodian`: it
    starts every replacement (on shared devices only while the trainer is off them, brought to
    its peers' memory state) and gives it the weights."""

    def __init__(self, engines: Any, trainer: Any, weights: Any, *, shared: bool, offload: str = "everything",
                 keep_spares_across_saves: bool = False) -> None:
        """``weights``: the engines' weight sync (its ``sync(version, only)`` returns the push's
        ``sync_bytes`` and ``push_s``). ``shared``: the engines sit on the trainer's devices
        (their memory handed back by :func:`hand_devices_to_trainer` before the trainer was
        built); ``offload``: what the trainer hands them for a rollout phase (``cluster.offload``,
        resolved by the planner: ``everything``, ``optimizer`` or ``nothing``, which keeps both on
        the devices as if apart), its host buffers allocated now, before the first step, and kept
        across checkpoint saves with ``keep_spares_across_saves``."""
        self.version = 0  # the trainer's weights: how many updates (RL steps) they have taken
        self._engines, self._trainer, self._weights = engines, trainer, weights
        self.taking_turns = taking_turns(shared, offload)
        self.offload = offload
        self._moved = dict.fromkeys(MOVE_KEYS, 0.0)
        self._owner = "train"  # who holds the devices: the trainer ("train") or the engines ("rollout")
        self._stale = True  # the engines do not hold the trainer's current weights
        # what the engines hold of their device memory
        self._memory = RELEASED if self.taking_turns else HELD
        if self.taking_turns:
            trainer.plan_offload(offload, keep_spares_across_saves)
        engines.entrust(self)

    def take_moves(self) -> dict[str, float]:
        """What moved since the last call (:data:`MOVE_KEYS`, every key, zero when nothing ran)
        and the pushes' bytes per second."""
        moved, self._moved = self._moved, dict.fromkeys(MOVE_KEYS, 0.0)
        moved["sync_bytes_per_s"] = moved["sync_bytes"] / moved["push_s"] if moved["push_s"] else 0.0
        return moved

    def weights_changed(self, version: int) -> None:
        """The trainer's weights are now the ``version``-th update."""
        self.version, self._stale = version, True

    def rollout(self) -> None:
        """Hand the devices to the engines, syncing the weights first if they changed (or if an
        engine was replaced meanwhile)."""
        while True:
            if self._stale or self._engines.unsynced:
                full = self._stale or self.taking_turns
                if self.taking_turns:
                    self.train()  # a sync reads the trainer's weights where they live
                    # the trainer's allocator still caches the step's activations: free them
                    # before the engines take back their weights' memory beside it
                    self._trainer.release_cached_memory()
                    self._engines_hold(WEIGHTS_ONLY)
                self._pushed(None if full else sorted(self._engines.unsynced))
                self._stale = False
            if self.taking_turns and self._owner == "train":
                self._offload_trainer()
                self._owner = "rollout"
                self._engines_hold(HELD)
            if not (self._stale or self._engines.unsynced):  # an engine replaced meanwhile needs the weights
                return

    def train(self) -> None:
        """Hand the devices to the trainer. Engines that released their weights hold them no more
        (SGLang keeps no copy): they are synced again at the next rollout phase."""
        if self.taking_turns and self._owner == "rollout":
            self._engines_hold(RELEASED)
            self._onload_trainer()
            self._owner, self._stale = "train", True

    def resync(self, indices: list[int]) -> None:
        """Give engines that were just replaced (they hold the initial weights) the current ones,
        in whatever phase the step is, before any of their requests is sent again."""
        if not self.taking_turns:
            self._pushed(indices)
            self._engines.unsynced.difference_update(indices)
            return
        self._stale = True  # the weights reach engines sharing the trainer's devices in a full sync only
        if self._owner == "rollout":
            self.rollout()

    def starting_engines(self, indices: list[int], start: Callable[[], None]) -> None:
        """Run ``start()`` (new engines for ``indices``) when their devices are free, then leave
        them holding what their peers hold. A server that starts beside a trainer holding the
        devices would find no memory for its KV cache, or fail to start."""
        trainer_on_device = self.taking_turns and self._owner == "train"
        if trainer_on_device:
            self._offload_trainer()
        start()
        if self.taking_turns and self._memory != HELD:
            self._engines.release_memory(only=indices)
            if self._memory == WEIGHTS_ONLY:
                self._timed("resume_s", self._engines.resume_memory, WEIGHTS, only=indices)
        if trainer_on_device:
            self._onload_trainer()

    def _pushed(self, only: list[int] | None) -> None:
        report = self._weights.sync(self.version, only)
        self._moved["sync_bytes"] += report["sync_bytes"]
        self._moved["push_s"] += report["push_s"]

    def _offload_trainer(self) -> None:
        self._moved["offload_bytes"] += float(self._timed("offload_s", self._trainer.offload))

    def _onload_trainer(self) -> None:
        self._timed("onload_s", self._trainer.onload)

    def _timed(self, key: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self._moved[key] += time.perf_counter() - start

    def _engines_hold(self, memory: str) -> None:
        """Every engine releases or resumes memory until it holds ``memory``: set first, so an
        engine replaced during these calls is started into it."""
        self._memory = memory
        if memory == RELEASED:
            self._engines.release_memory()
        elif memory == WEIGHTS_ONLY:
            self._timed("resume_s", self._engines.resume_memory, WEIGHTS)
        else:  # the rest of what they released (engines resume only what they released)
            self._timed("resume_s", self._engines.resume_memory, ())
