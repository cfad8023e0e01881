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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# What an engine resumes before a sync (its weights) and after the trainer left (the rest)
WEIGHTS, AFTER_SYNC = ("weights",), ("kv_cache", "cuda_graph")


class DevicePhases:
    """Create it right after the engines started (holding their initial weights and caches): on
    shared devices they hand that memory back at once, so the trainer can be built; then
    :meth:`attach_trainer`."""

    def __init__(self, engines: Any, push: Callable[[list[int] | None, int], dict[str, float]], *,
                 shared: bool) -> None:
        self._trainer: Any = None
        self.version = 0  # the trainer's weights: how many updates (RL steps) they have taken
        self._engines, self._push = engines, push
        self.shared = shared
        self._owner = "train"  # who holds the devices: the trainer ("train") or the engines ("rollout")
        self._stale = True  # the engines do not hold the trainer's current weights
        if shared:
            engines.call("release_memory")

    def attach_trainer(self, trainer: Any) -> None:
        self._trainer = trainer

    def weights_changed(self, version: int) -> None:
        """The trainer's weights are now the ``version``-th update."""
        self.version, self._stale = version, True

    def rollout(self) -> dict[str, float]:
        """Hand the devices to the engines, syncing the weights first if they changed; returns
        the sync's metrics (empty when none ran)."""
        metrics: dict[str, float] = {}
        if self._stale:
            if self.shared:
                self.train()  # a sync reads the trainer's weights where they live
                self._engines.call("resume_memory", WEIGHTS)
            metrics = self._push(None, self.version)
            self._stale = False
        if self.shared and self._owner == "train":
            moved = self._trainer.call("offload")[0]
            self._engines.call("resume_memory", AFTER_SYNC if "sync_bytes" in metrics else ())
            self._owner = "rollout"
            metrics["offload_bytes"] = float(moved)
        return metrics

    def train(self) -> None:
        """Hand the devices to the trainer. Engines that released their weights hold them no more
        (SGLang keeps no copy): they are synced again at the next rollout phase."""
        if self.shared and self._owner == "rollout":
            self._engines.call("release_memory")
            self._trainer.call("onload")
            self._owner, self._stale = "train", True

    def resync(self, indices: list[int]) -> None:
        """Give engines that were just replaced (they hold the initial weights) the current ones,
        in whatever phase the step is, before any of their requests is sent again."""
        if not self.shared:
            self._push(indices, self.version)
        elif self._owner == "rollout":
            self.train()  # every engine hands its memory back; the next rollout phase syncs them all
            self.rollout()
        else:  # the new engines came up holding memory: the trainer holds the devices
            self._engines.call("release_memory", only=indices)
