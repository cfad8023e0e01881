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

WEIGHTS, KV_CACHE = "weights", "kv_cache"


class DevicePhases:
    """Create it right after the engines started (holding their initial weights and caches): on
    shared devices they hand that memory back at once, so the trainer can be built; then
    :meth:`attach_trainer`."""

    def __init__(self, engines: Any, push: Callable[[list[int] | None], dict[str, float]], *, shared: bool) -> None:
        self._trainer: Any = None
        self._engines, self._push = engines, push
        self.shared = shared
        self._owner = "train"  # who holds the devices: the trainer ("train") or the engines ("rollout")
        self._stale = True  # the engines do not hold the trainer's current weights
        if shared:
            engines.call("release_memory")

    def attach_trainer(self, trainer: Any) -> None:
        self._trainer = trainer

    def weights_changed(self) -> None:
        self._stale = True

    def rollout(self) -> dict[str, float]:
        """Hand the devices to the engines, syncing the weights first if they changed; returns
        the sync's metrics (empty when none ran)."""
        metrics: dict[str, float] = {}
        if self._stale:
            if self.shared:
                self.train()  # a sync reads the trainer's weights where they live
                self._engines.call("resume_memory", (WEIGHTS,))
            metrics = self._push(None)
            self._stale = False
        if self.shared and self._owner == "train":
            moved = self._trainer.call("offload")[0]
            self._engines.call("resume_memory", (KV_CACHE,) if metrics else (WEIGHTS, KV_CACHE))
            self._owner = "rollout"
            metrics["offload_bytes"] = float(moved)
        return metrics

    def train(self) -> None:
        """Hand the devices to the trainer."""
        if self.shared and self._owner == "rollout":
            self._engines.call("release_memory")
            self._trainer.call("onload")
            self._owner = "train"

    def resync(self, indices: list[int]) -> None:
        """Give engines that were just replaced (they hold the initial weights) the current ones,
        in whatever phase the step is; the devices end up with whoever held them."""
        if not self.shared:
            self._push(indices)
            return
        in_rollout = self._owner == "rollout"
        if in_rollout:
            self.train()  # every engine, the new ones too, hands its memory back
        else:
            self._engines.call("release_memory", only=indices)  # the new ones came up holding memory
        self._engines.call("resume_memory", (WEIGHTS,), only=indices)
        self._push(indices)
        if in_rollout:
            self._trainer.call("offload")
            others = [i for i in range(len(self._engines.workers)) if i not in indices]
            self._engines.call("resume_memory", (KV_CACHE,), only=indices)
            self._engines.call("resume_memory", (WEIGHTS, KV_CACHE), only=others)
            self._owner = "rollout"
        else:
            self._engines.call("release_memory", only=indices)
