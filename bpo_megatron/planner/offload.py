"""What a colocated trainer hands its engines while they generate (``cluster.offload``), chosen by
what fits the GPUs.

Colocated, trainer and engines take turns on each GPU (``orchestration/phases.py``). What must
leave it for a rollout phase is what does not fit beside the engine, per choice
(:data:`RULES`; the trainer moves the same parts, ``trainer/offload.py``'s ``OFFLOAD_PARTS``):

* ``nothing``: trainer and engine hold the GPU together throughout: the trainer's training peak
  (static memory, activations, logits, reserved) beside the engine's weights, KV cache and runtime;
* ``optimizer``: the optimizer state (fp32 master weights and Adam moments) goes to host memory
  and the gradient buffers are freed while the engines generate; the weights stay;
* ``everything``: the weights go too; only the trainer's residual (CUDA context, NCCL) stays.

While the trainer computes, engines that share its GPU have released their memory (SGLang its
weights and KV cache; the embedded engine its decode states, its weights stay: what an engine
keeps is its profile's ``releases_weights``), except with ``nothing``, where they release
nothing. ``auto`` takes the first choice that fits, in :data:`ORDER` (least traffic first: every
byte offloaded crosses the host link twice a step); a choice that does not fit is refused, naming
``cluster.offload``. A CPU allocation has no device budget: ``auto`` offloads everything there,
the path CPU runs test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bpo_megatron.planner.plan import StagePlan
    from bpo_megatron.planner.precision import StaticMemory


@dataclass(frozen=True)
class OffloadRule:
    """What one choice moves and keeps, for one pipeline stage's rank."""

    moved: Callable[[StaticMemory], int]  # bytes an offload copies to host memory (and back)
    # bytes the trainer keeps on the GPU while the engines generate, given its residual
    trainer_left: Callable[[StagePlan, float], float]
    engines_release: bool  # the engines hand their memory back while the trainer computes


RULES = {
    "nothing": OffloadRule(moved=lambda static: 0, trainer_left=lambda stage, residual: stage.total,
                           engines_release=False),
    "optimizer": OffloadRule(moved=lambda static: static.optimizer,
                             trainer_left=lambda stage, residual: stage.static.weights + residual, engines_release=True),
    "everything": OffloadRule(moved=lambda static: static.weights + static.optimizer,
                              trainer_left=lambda stage, residual: residual, engines_release=True),
}
ORDER = ("nothing", "optimizer", "everything")  # auto: the first that fits
CPU_DEFAULT = "everything"  # auto on a CPU allocation (no device budget to plan against)


@dataclass(frozen=True)
class OffloadOption:
    """One choice on the busiest GPU: the bytes each offload moves, and the device memory of each
    phase (the largest over the pipeline stages)."""

    parts: str
    moved: float
    rollout_phase: float
    train_phase: float

    @property
    def peak(self) -> float:
        return max(self.rollout_phase, self.train_phase)


@dataclass(frozen=True)
class OffloadPlan:
    """``setting``: ``cluster.offload`` as configured; ``options``: every choice in :data:`ORDER`
    against ``cap`` bytes per GPU (none on a CPU allocation, ``cap`` None)."""

    setting: str
    options: tuple[OffloadOption, ...]
    cap: float | None

    def fitting(self, option: OffloadOption) -> bool:
        return self.cap is None or option.peak <= self.cap

    @property
    def chosen(self) -> OffloadOption | None:
        """The option the run takes: the setting's, or auto's first that fits; None when it does
        not fit (or, on a CPU allocation, there are no options to show)."""
        if self.setting == "auto":
            return next((o for o in self.options if self.fitting(o)), None)
        option = next((o for o in self.options if o.parts == self.setting), None)
        return option if option is not None and self.fitting(option) else None

    @property
    def parts(self) -> str:
        """What the trainer offloads: the chosen option's parts; the setting on a CPU allocation
        (auto: everything); when nothing fits, the most there is (the run is refused anyway)."""
        if self.cap is None:
            return CPU_DEFAULT if self.setting == "auto" else self.setting
        chosen = self.chosen
        return chosen.parts if chosen is not None else (ORDER[-1] if self.setting == "auto" else self.setting)

    @property
    def fits(self) -> bool:
        return self.cap is None or self.chosen is not None

    def refusal(self) -> str | None:
        """Why the setting cannot run on these GPUs, naming cluster.offload and what fits instead;
        None when it can."""
        if self.fits:
            return None
        gb = lambda n: f"{n / 1e9:.2f}"  # noqa: E731
        fitting = [o.parts for o in self.options if self.fitting(o)]
        if self.setting == "auto":
            most = self.options[-1]  # ORDER ends with the choice that offloads the most
            return (f"cluster.offload=auto: no choice fits {gb(self.cap)} GB per GPU (even {most.parts}, offloading "
                    f"the most, needs {gb(most.peak)} GB): bpo-megatron plan shows where the memory goes")
        option = next(o for o in self.options if o.parts == self.setting)
        instead = f"cluster.offload={fitting[0]} fits" if fitting else "no choice fits"
        return (f"cluster.offload={self.setting} does not fit: {gb(option.rollout_phase)} GB while the engines "
                f"generate and {gb(option.train_phase)} GB while the trainer computes, on GPUs of {gb(self.cap)} GB; "
                f"{instead} (auto takes the least offload that fits)")

    def describe(self) -> str:
        """One line: the choice and why (what the setting asked for, what fits)."""
        gb = lambda n: f"{n / 1e9:.2f}"  # noqa: E731
        if self.cap is None:
            return (f"cluster.offload={self.setting}: the trainer offloads {self.parts} for each rollout phase "
                    "(a CPU allocation: no device budget to plan against)")
        chosen = self.chosen
        if chosen is None:
            return self.refusal()
        moved = f", {gb(chosen.moved)} GB to host memory and back each step" if chosen.moved else ""
        how = "the least offload that fits" if self.setting == "auto" else "as set"
        return (f"cluster.offload={self.setting}: the trainer offloads {chosen.parts} for each rollout phase ({how}"
                f"{moved}; peak {gb(chosen.peak)} of {gb(self.cap)} GB per GPU)")


def offload_plan(setting: str, stages: list[StagePlan], *, engine: float | None, engine_kept: float,
                 residual: float, cap: float | None) -> OffloadPlan:
    """The choices for ``stages`` beside an engine of ``engine`` bytes per GPU (weights, KV cache
    and runtime; None on a CPU allocation) that keeps ``engine_kept`` of them when released, a
    trainer whose residual is ``residual`` bytes when it offloads, on GPUs of ``cap`` bytes."""
    if engine is None or not stages:
        return OffloadPlan(setting, (), None)
    options = []
    for parts in ORDER:
        rule = RULES[parts]
        engine_while_training = engine_kept if rule.engines_release else engine
        options.append(OffloadOption(
            parts=parts,
            moved=max(rule.moved(s.static) for s in stages),
            rollout_phase=max(engine + rule.trainer_left(s, residual) for s in stages),
            train_phase=max(s.total + engine_while_training for s in stages)))
    return OffloadPlan(setting, tuple(options), cap)
