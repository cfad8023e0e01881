"""Micro-batches per data-parallel rank, load imbalance and useful tokens, for a stated length
distribution: padded micro-batches (``trainer.micro_batch_size``) against packed ones
(``trainer.max_tokens_per_micro_batch``).

An estimate, by a seeded Monte Carlo of whole steps (deterministic: the same config, distribution
and seed give the same figures). The model:

* **Cost.** A sample costs its input positions, prompt + response − 1, and compute is taken as
  linear in positions (the MoE and MLP layers dominate; attention's quadratic term is left out).
* **Padded.** A pass's samples are cut into ``dp`` contiguous, nearly equal shares in sample
  order, each into micro-batches of ``micro_batch_size`` samples in order (the trainer's
  ``split`` and ``chunk``); a micro-batch pays ``b ×`` its longest sample.
* **Packed** (the balancing this estimate assumes; the trainer's may differ in its details).
  Samples are sorted by cost and dealt largest first, each to the rank with the fewest positions
  so far (LPT). Every rank then runs the same number ``M`` of micro-batches: ``M`` starts at the
  largest ``ceil(rank's positions / budget)`` (or the count that samples longer than
  ``budget / (t + 1)`` need, t at a time, when larger) and is raised one at a time until every
  rank's samples, dealt largest first into ``M`` bins by LPT again, leave no bin over the budget.
  A pack pays its positions. Bins run largest first on every rank.
* Every micro-batch is rounded up to a multiple of TP under sequence parallelism, as the trainer
  pads it.
* **Lockstep.** The data-parallel ranks holding ranks of one expert-parallel group run each
  micro-batch's all-to-alls together, so each pays the largest of their j-th micro-batches
  (Megatron's rank order: attention ranks tp-major then dp, expert ranks etp, then ep, then
  expert dp). Without expert parallelism across DP ranks every rank pays its own.
* **Useful tokens** = real positions / positions paid, summed over the ranks. **Imbalance** =
  the busiest rank's paid positions / the mean rank's: a pass waits for the busiest rank at the
  gradient reduction (or the log-prob gather), so a pass takes imbalance / useful times the
  ideal. Pipeline bubbles are left out.

Figures are means over ``steps`` simulated steps: each step's ``responses_per_step`` samples are
drawn, cut into its ``minibatches_per_step`` minibatches (one training pass each), and the
whole step is the log-prob pass (``train.recompute_old_logprobs``).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.planner.activations import round_up

if TYPE_CHECKING:
    from bpo_megatron.experiment import ExperimentConfig

DEFAULT_STEPS = 8
DEFAULT_SEED = 0


# ------------------------------------------------------------------------------- lengths
@dataclass(frozen=True)
class LengthDistribution:
    """How long a step's prompts and responses are (tokens), given the config's limits."""

    name: str
    describe: Callable[[int, int], str]  # (data.max_prompt_tokens, rollout.max_new_tokens) → what it assumes
    draw: Callable[[random.Random, int, int], tuple[int, int]]  # → (prompt, response) tokens


# "paper": what a DAPO-Math-like run is assumed to produce (not measured here): short math prompts,
# responses spread over orders of magnitude, and many cut off at the limit.
PAPER_PROMPT_TOKENS = (50, 300)
PAPER_SHORTEST_RESPONSE = 256
PAPER_AT_CAP = 0.3


def _paper(rng: random.Random, max_prompt: int, max_new: int) -> tuple[int, int]:
    low, high = (min(n, max_prompt) for n in PAPER_PROMPT_TOKENS)
    prompt = rng.randint(low, high)
    if rng.random() < PAPER_AT_CAP:
        return prompt, max_new
    shortest = min(PAPER_SHORTEST_RESPONSE, max_new)
    return prompt, min(max_new, round(math.exp(rng.uniform(math.log(shortest), math.log(max_new)))))


def _describe_paper(max_prompt: int, max_new: int) -> str:
    low, high = (min(n, max_prompt) for n in PAPER_PROMPT_TOKENS)
    shortest = min(PAPER_SHORTEST_RESPONSE, max_new)
    prompts = f"prompts uniform {low}–{high} tokens" if low < high else f"prompts of {low} tokens"
    responses = f"log-uniform {shortest}–{max_new}" if shortest < max_new else f"of {max_new}"
    return f"{prompts}, responses {responses} with {PAPER_AT_CAP:.0%} at the cap"


LENGTH_DISTRIBUTIONS: dict[str, LengthDistribution] = {d.name: d for d in (
    LengthDistribution("paper", _describe_paper, _paper),
    LengthDistribution("max", lambda p, n: f"every sample at the caps, {p} + {n} tokens (the worst case)",
                       lambda rng, p, n: (p, n)),
)}


# ------------------------------------------------------------------------------- one pass
@dataclass(frozen=True)
class PassCost:
    """One pass (a minibatch's training, or the log-prob pass) over all data-parallel ranks."""

    micro_batches: int  # per rank (every rank runs as many)
    real: int  # positions of the samples
    paid: list[int]  # per rank: Σ over its micro-batches of the largest of its lockstep group's

    @property
    def useful(self) -> float:
        return self.real / max(sum(self.paid), 1)

    @property
    def imbalance(self) -> float:
        mean = sum(self.paid) / len(self.paid)
        return max(self.paid) / mean if mean else 1.0


def lockstep_groups(parallel: ParallelConfig, trainer_ranks: int, *, moe: bool) -> list[list[int]]:
    """The data-parallel ranks that run every micro-batch together: those whose ranks share an
    expert-parallel group (in a pipeline stage, attention rank r is DP rank r // tp; expert rank
    r is etp rank r % etp of EP group r // (etp · ep)). Each DP rank alone for a dense model."""
    dp = trainer_ranks // (parallel.tp * parallel.pp)
    parent = list(range(dp))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    if moe:
        etp, ep = parallel.expert_tp, parallel.ep
        first_of: dict[tuple[int, int], int] = {}
        for rank in range(trainer_ranks // parallel.pp):
            group = (rank % etp, rank // (etp * ep))
            other = first_of.setdefault(group, rank // parallel.tp)
            parent[root(rank // parallel.tp)] = root(other)
    groups: dict[int, list[int]] = {}
    for rank in range(dp):
        groups.setdefault(root(rank), []).append(rank)
    return list(groups.values())


def _pay(sizes: list[list[int]], groups: list[list[int]]) -> list[int]:
    """Per rank: its j-th micro-batch pays the largest j-th micro-batch of its lockstep group."""
    count = max(len(s) for s in sizes)
    rows = [s + [0] * (count - len(s)) for s in sizes]
    paid = [0] * len(sizes)
    for group in groups:
        total = sum(max(rows[r][j] for r in group) for j in range(count))
        for r in group:
            paid[r] = total
    return paid


def _lpt(costs: list[int], parts: int) -> list[list[int]]:
    """Costs (sorted largest first) dealt, each to the part with the least so far (ties: the
    lowest index)."""
    heap = [(0, i) for i in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for cost in costs:
        load, i = heapq.heappop(heap)
        out[i].append(cost)
        heapq.heappush(heap, (load + cost, i))
    return out


def padded_pass(costs: list[int], *, dp: int, micro_batch_size: int, pad: int,
                groups: list[list[int]]) -> PassCost:
    size, extra = divmod(len(costs), dp)
    bounds = [i * size + min(i, extra) for i in range(dp + 1)]
    sizes = []
    for r in range(dp):
        share = costs[bounds[r]:bounds[r + 1]]
        chunks = [share[i:i + micro_batch_size] for i in range(0, len(share), micro_batch_size)]
        sizes.append([len(c) * round_up(max(c), pad) for c in chunks])
    return PassCost(micro_batches=max(len(s) for s in sizes), real=sum(costs), paid=_pay(sizes, groups))


def _fewest_bins(costs: list[int], budget: int) -> int:
    """A lower bound on the bins of ``budget`` that ``costs`` need: their total, and samples
    longer than budget / (t + 1), of which no bin holds more than t."""
    bound = math.ceil(sum(costs) / budget)
    for t in range(1, 9):
        bound = max(bound, math.ceil(sum(1 for c in costs if c * (t + 1) > budget) / t))
    return bound


def packed_pass(costs: list[int], *, dp: int, budget: int, pad: int, groups: list[list[int]]) -> PassCost:
    ordered = sorted(costs, reverse=True)
    parts = _lpt(ordered, dp)
    count = max(_fewest_bins(part, budget) for part in parts)
    while True:
        bins = [_lpt(part, count) for part in parts]
        if all(sum(b) <= budget for rank in bins for b in rank):
            break
        count += 1  # ends at the latest when every sample has a bin of its own (each fits the budget)
    sizes = [sorted((round_up(sum(b), pad) for b in rank), reverse=True) for rank in bins]
    return PassCost(micro_batches=count, real=sum(costs), paid=_pay(sizes, groups))


# ------------------------------------------------------------------------------- the estimate
@dataclass(frozen=True)
class PassStats:
    micro_batches: float  # per DP rank, mean over the simulated passes
    most_micro_batches: int  # per DP rank, the most in any simulated pass
    imbalance: float  # busiest rank / mean rank, mean over the passes
    useful: float  # real / paid positions over all the passes

    @classmethod
    def of(cls, passes: list[PassCost]) -> PassStats:
        return cls(micro_batches=sum(p.micro_batches for p in passes) / len(passes),
                   most_micro_batches=max(p.micro_batches for p in passes),
                   imbalance=sum(p.imbalance for p in passes) / len(passes),
                   useful=sum(p.real for p in passes) / max(sum(sum(p.paid) for p in passes), 1))


@dataclass(frozen=True)
class PassEstimate:
    samples: int  # the pass's samples over all DP ranks
    padded: PassStats
    packed: PassStats | None  # None without a token budget


@dataclass(frozen=True)
class BatchEstimate:
    lengths: str  # the distribution's name
    description: str
    steps: int
    seed: int
    mean_positions: float  # a sample's mean cost
    minibatch: PassEstimate  # one training pass (minibatches_per_step a step)
    logprob: PassEstimate  # the log-prob pass over the whole step


def estimate_batches(cfg: ExperimentConfig, *, dp: int, groups: list[list[int]], lengths: str,
                     steps: int = DEFAULT_STEPS, seed: int = DEFAULT_SEED) -> BatchEstimate:
    """Micro-batches per DP rank, imbalance and useful tokens of the padded and (with a budget)
    the packed micro-batches, for the ``lengths`` distribution (:data:`LENGTH_DISTRIBUTIONS`)."""
    distribution = LENGTH_DISTRIBUTIONS[lengths]
    max_prompt, max_new = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    pad = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1
    budget, b = cfg.trainer.max_tokens_per_micro_batch, cfg.trainer.micro_batch_size
    if budget < max_prompt + max_new - 1:
        budget = 0  # packing cannot hold the longest sample (a failed layout check says so): padded only
    rng = random.Random(seed)
    runs: dict[tuple[str, str], list[PassCost]] = {}
    drawn: list[int] = []
    for _ in range(steps):
        step = [sum(distribution.draw(rng, max_prompt, max_new)) - 1 for _ in range(cfg.responses_per_step)]
        drawn += step
        size = cfg.minibatch_size
        passes = [("minibatch", step[i:i + size]) for i in range(0, len(step), size)] + [("logprob", step)]
        for name, costs in passes:
            runs.setdefault((name, "padded"), []).append(
                padded_pass(costs, dp=dp, micro_batch_size=b, pad=pad, groups=groups))
            if budget:
                runs.setdefault((name, "packed"), []).append(
                    packed_pass(costs, dp=dp, budget=budget, pad=pad, groups=groups))

    def estimate(name: str, samples: int) -> PassEstimate:
        packed = runs.get((name, "packed"))
        return PassEstimate(samples=samples, padded=PassStats.of(runs[(name, "padded")]),
                            packed=PassStats.of(packed) if packed else None)

    return BatchEstimate(lengths=lengths, description=distribution.describe(max_prompt, max_new), steps=steps,
                         seed=seed, mean_positions=sum(drawn) / len(drawn),
                         minibatch=estimate("minibatch", cfg.minibatch_size),
                         logprob=estimate("logprob", cfg.responses_per_step))
