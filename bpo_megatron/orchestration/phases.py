"""Who holds the devices between the phases of an RL step, and which weights the engines hold.

The loop calls :meth:`DevicePhases.rollout` before the engines generate and
:meth:`DevicePhases.train` before the trainer computes; :meth:`DevicePhases.weights_changed` after
every optimizer update.

* **Weights.** The engines are synced at the start of the first rollout phase after the trainer's
  weights changed, so every generation sees the newest weights and a run that generates nothing
  after its last update syncs nothing.
* **Devices** (``cluster.colocate``). Engines that share the trainer's devices get them in turns:
  a rollout phase offloads the trainer (parameters, gradient buffers and optimizer state to host
  memory, its device memory freed) and resumes the engines' memory; a train phase releases the
  engines' memory (weights and KV cache) and onloads the trainer. A sync needs both sides'
  weights on the device: the engines get their weights' memory back before it and their KV cache
  only after the trainer has left. On separate devices nothing moves.
* **Replacements** (an engine that died or hung in any phase): started while the trainer is off
  the devices (it is offloaded for the moment it takes, if need be), released or resumed to what
  its peers hold, and given the current weights before its next request: at once on devices of
  its own, by a full sync on shared ones (the next rollout phase, or at once during one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# What an engine resumes before a sync: its weights (the rest after the trainer left)
WEIGHTS = ("weights",)
# What engines hold: everything, only their weights (during a colocated sync), nothing
HELD, WEIGHTS_ONLY, RELEASED = "held", "weights", "released"


class DevicePhases:
    """Create it right after the engines started (holding their initial weights and caches): on
    shared devices they hand that memory back at once, so the trainer can be built; then
    :meth:`attach_trainer`. It also starts every replacement engine (``engines.start_hook``): on
    shared devices only while the trainer is off them, and brought to its peers' memory state."""

    def __init__(self, engines: Any, push: Callable[[list[int] | None, int], dict[str, float]], *,
                 shared: bool) -> None:
        self._trainer: Any = None
        self.version = 0  # the trainer's weights: how many updates (RL steps) they have taken
        self._engines, self._push = engines, push
        self.shared = shared
        self._owner = "train"  # who holds the devices: the trainer ("train") or the engines ("rollout")
        self._stale = True  # the engines do not hold the trainer's current weights
        self._memory = HELD  # what the engines hold of their device memory
        engines.start_hook = self.starting_engines
        if shared:
            self._engines_hold(RELEASED)

    def attach_trainer(self, trainer: Any) -> None:
        self._trainer = trainer

    def weights_changed(self, version: int) -> None:
        """The trainer's weights are now the ``version``-th update."""
        self.version, self._stale = version, True

    def rollout(self) -> dict[str, float]:
        """Hand the devices to the engines, syncing the weights first if they changed (or if an
        engine was replaced meanwhile); returns the sync's metrics (empty when none ran)."""
        metrics: dict[str, float] = {}
        while True:
            if self._stale or self._engines.unsynced:
                full = self._stale or self.shared
                if self.shared:
                    self.train()  # a sync reads the trainer's weights where they live
                    # the trainer's allocator still caches the step's activations: free them
                    # before the engines take back their weights' memory beside it
                    self._trainer.release_cached_memory()
                    self._engines_hold(WEIGHTS_ONLY)
                metrics.update(self._push(None if full else sorted(self._engines.unsynced), self.version))
                self._stale = False
            if self.shared and self._owner == "train":
                moved = self._trainer.offload()
                self._owner = "rollout"
                self._engines_hold(HELD)
                metrics["offload_bytes"] = float(moved)
            if not (self._stale or self._engines.unsynced):  # an engine replaced meanwhile needs the weights
                return metrics

    def train(self) -> None:
        """Hand the devices to the trainer. Engines that released their weights hold them no more
        (SGLang keeps no copy): they are synced again at the next rollout phase."""
        if self.shared and self._owner == "rollout":
            self._engines_hold(RELEASED)
            self._trainer.onload()
            self._owner, self._stale = "train", True

    def resync(self, indices: list[int]) -> None:
        """Give engines that were just replaced (they hold the initial weights) the current ones,
        in whatever phase the step is, before any of their requests is sent again."""
        if not self.shared:
            self._push(indices, self.version)
            self._engines.unsynced.difference_update(indices)
            return
        self._stale = True  # the weights reach engines sharing the trainer's devices in a full sync only
        if self._owner == "rollout":
            self.rollout()

    def starting_engines(self, indices: list[int], start: Callable[[], None]) -> None:
        """Run ``start()`` (new engines for ``indices``) when their devices are free, then leave
        them holding what their peers hold. A server that starts beside a trainer holding the
        devices would find no memory for its KV cache, or fail to start."""
        trainer_on_device = self.shared and self._owner == "train" and self._trainer is not None
        if trainer_on_device:
            self._trainer.offload()
        start()
        if self.shared and self._memory != HELD:
            self._engines.release_memory(only=indices)
            if self._memory == WEIGHTS_ONLY:
                self._engines.resume_memory(WEIGHTS, only=indices)
        if trainer_on_device:
            self._trainer.onload()

    def _engines_hold(self, memory: str) -> None:
        """Every engine releases or resumes memory until it holds ``memory``: set first, so an
        engine replaced during these calls is started into it."""
        self._memory = memory
        if memory == RELEASED:
            self._engines.release_memory()
        elif memory == WEIGHTS_ONLY:
            self._engines.resume_memory(WEIGHTS)
        else:  # the rest of what they released (engines resume only what they released)
            self._engines.resume_memory(())
