"""Rollouts generated ahead of training (``train.async.max_staleness`` k).

Weights version v are those after RL step v; step s trains the weights of version s − 1, so a
response sampled by version v is ``(s − 1) − v`` updates stale when step s trains on it. At the
start of step s the engines finish what they are generating (:meth:`RolloutPipeline.settle`),
take version s − 1, and the batches of steps s … s + k not yet under way start generating with it
(:meth:`~RolloutPipeline.plan`); step s then trains on its own batch (:meth:`~RolloutPipeline.take`)
while those of the next steps generate. So the batch of step s + k was sampled by version s − 1
and is exactly k stale when trained on; with k = 0 each batch is generated and trained on in the
same step, the synchronous loop. An engine that cannot pause a generation takes a weight update
only between generations (its calls run in order), so there k > 1 adds staleness but no more
overlap than k = 1.

With engines that pause a generation for a weight update and continue it with the new weights
(partial rollouts, ``EngineSpec.partial_rollouts``: the embedded engine, SGLang), nothing is waited for:
the batches under way carry on across the sync, their later tokens sampled by the newer weights;
a response's staleness is that of its oldest token, so it is at most k all the same, and k > 1
overlaps more.

A response older than k anyway (an engine replaced by one holding older weights, say) is caught
from the version every sample records: its group is regenerated with the current weights, or
dropped and replaced by fresh prompts (``train.async.stale``). A checkpoint stores the data cursor
at the first prompt no step has trained on, so a resume generates the batches that were under way
again: no prompt is lost (the responses differ: they are sampled by the weights of the resume).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from bpo_megatron.rollout import Sample

STALE_ROUND = 1000  # request tags and seeds of regenerated groups, apart from every other round

# (prompts, step, round) -> the generation requests of those prompts for that step
RequestBatch = Callable[[list, int, int], list]


@dataclass
class PlannedBatch:
    step: int  # the step that trains on it
    prompts: list  # the encoded prompts, one per group
    start_cursor: int  # the data cursor at its first prompt
    pending: object  # the generation under way (orchestration.groups.PendingGeneration)


def staleness(samples: list[Sample], step: int) -> list[int]:
    """How many updates behind the weights step ``step`` trains each sample was sampled by."""
    return [(step - 1) - sample.weight_version for sample in samples]


def stale_groups(samples: list[Sample], group_size: int, step: int, max_staleness: int) -> list[int]:
    """The groups holding a sample more than ``max_staleness`` updates old."""
    ages = staleness(samples, step)
    return sorted({i // group_size for i, age in enumerate(ages) if age > max_staleness})


class RolloutPipeline:
    def __init__(self, engines, prompts, request_batch: RequestBatch, *, per_step: int, group_size: int,
                 last_step: int, max_staleness: int, stale: str, partial: bool = False) -> None:
        self.engines, self.prompts, self.request_batch, self.partial = engines, prompts, request_batch, partial
        self.per_step, self.group_size, self.last_step = per_step, group_size, last_step
        self.max_staleness, self.stale = max_staleness, stale
        self._planned: deque[PlannedBatch] = deque()

    def settle(self) -> None:
        """Wait until the engines have generated every planned batch (before they take weights);
        engines with partial rollouts pause instead, so nothing is waited for."""
        if self.partial:
            return
        for planned in self._planned:
            planned.pending.result()

    def plan(self, step: int) -> None:
        """Start generating the batches of steps ``step`` … ``step + k`` not yet under way."""
        next_step = self._planned[-1].step + 1 if self._planned else step
        while next_step <= min(step + self.max_staleness, self.last_step):
            start = self.prompts.cursor
            batch = self.prompts.take(self.per_step)
            pending = self.engines.submit(self.request_batch(batch, next_step, 0))
            self._planned.append(PlannedBatch(next_step, batch, start, pending))
            next_step += 1

    def take(self, step: int) -> tuple[list[Sample], list, dict[str, float]]:
        """Step ``step``'s samples (grouped by prompt), its prompts, and its staleness metrics
        (none at k = 0, whose metrics are the synchronous loop's)."""
        planned = self._planned.popleft()
        if planned.step != step:
            raise RuntimeError(f"the rollout pipeline holds the batch of step {planned.step}, not of step {step}")
        samples, prompts = list(planned.pending.result()), list(planned.prompts)
        stale = stale_groups(samples, self.group_size, step, self.max_staleness)
        if stale:
            self._renew(stale, samples, prompts, step)
        if not self.max_staleness:
            return samples, prompts, {}
        ages = staleness(samples, step)
        spanning = sum(s.token_versions is not None and bool((s.token_versions != s.token_versions[0]).any())
                       for s in samples)
        return samples, prompts, {"async/staleness_mean": sum(ages) / len(ages), "async/staleness_max": float(max(ages)),
                                  "async/stale_groups": float(len(stale)), "async/partial_frac": spanning / len(samples)}

    def _renew(self, stale: list[int], samples: list[Sample], prompts: list, step: int) -> None:
        """Replace the stale groups in place: the same prompts sampled again, or fresh prompts."""
        again = [prompts[g] for g in stale] if self.stale == "regenerate" else self.prompts.take(len(stale))
        fresh = self.engines.generate(self.request_batch(again, step, STALE_ROUND))
        g = self.group_size
        for position, group in enumerate(stale):
            prompts[group] = again[position]
            samples[group * g:(group + 1) * g] = fresh[position * g:(position + 1) * g]

    def resume_cursor(self) -> int:
        """The data cursor a checkpoint stores: the first prompt of the batches still planned."""
        return self._planned[0].start_cursor if self._planned else self.prompts.cursor
