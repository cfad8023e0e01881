"""Micro-batches per data-parallel rank, load imbalance and useful tokens, for a stated length
distribution: padded micro-batches (``trainer.micro_batch_size``) against packed ones
(``trainer.max_tokens_per_micro_batch``).

An estimate, by a seeded Monte Carlo of whole steps (deterministic: the same config, distribution
and seed give the same figures) that runs the trainer's own balancer on the drawn lengths, so the
shares and micro-batches are the ones a run would make (``bpo_megatron.trainer.balance``; a test
checks the counts against the trainer's entry points):

* **Cost.** A sample has prompt + response − 1 input positions; its compute is the trainer's
  cost model (:class:`~bpo_megatron.trainer.balance.CostModel`: the matrix products linear in
  positions, causal attention quadratic, weighed by the model's shape).
* **Padded.** A pass's samples are cut into ``dp`` contiguous, nearly equal shares in sample
  order, each into micro-batches of ``micro_batch_size`` samples in order (the trainer's
  ``split`` and ``chunk``); a micro-batch pays ``b ×`` its longest sample.
* **Packed.** The trainer's shares (equal counts balanced by cost,
  :func:`~bpo_megatron.trainer.balance.balanced_shares`) and micro-batches (every rank the same
  count, the largest of the ranks' fewest, :func:`~bpo_megatron.trainer.balance.micro_batch_bins`),
  costliest first. A pack pays its positions.
* Every micro-batch is rounded up to a multiple of TP under sequence parallelism, as the trainer
  pads it. Under context parallelism a sample counts its share on each CP rank
  (:func:`~bpo_megatron.trainer.packing.rank_positions`), as the trainer's budget does.
* **Lockstep.** The data-parallel ranks holding ranks of one expert-parallel group run each
  micro-batch's all-to-alls together, so each pays the largest of their j-th micro-batches
  (Megatron's rank order: attention ranks tp-major then dp, expert ranks etp, then ep, then
  expert dp). Without expert parallelism across DP ranks every rank pays its own.
* **Useful tokens** = real positions / positions paid, summed over the ranks. **Imbalance** =
  the busiest rank's paid cost / the mean rank's: a pass waits for the busiest rank at the
  gradient reduction (or the log-prob gather). Pipeline bubbles are left out.

Figures are means over ``steps`` simulated steps: each step's ``responses_per_step`` samples are
drawn, cut into its ``minibatches_per_step`` minibatches (one training pass each), and the
whole step is the log-prob pass (``train.recompute_old_logprobs``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bpo_megatron.parallel import ParallelConfig
from bpo_megatron.planner.activations import round_up
from bpo_megatron.trainer.balance import CostModel, balanced_shares, fewest_micro_batches, micro_batch_bins
from bpo_megatron.trainer.packing import rank_positions
from bpo_megatron.trainer.samples import chunk, split

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
    paid: list[int]  # per rank: Σ over its micro-batches of the largest of its lockstep group's (positions)
    paid_cost: list[float]  # the same in the cost model's units (what the time follows)

    @property
    def useful(self) -> float:
        return self.real / max(sum(self.paid), 1)

    @property
    def imbalance(self) -> float:
        mean = sum(self.paid_cost) / len(self.paid_cost)
        return max(self.paid_cost) / mean if mean else 1.0


def lockstep_groups(parallel: ParallelConfig, trainer_ranks: int, *, moe: bool) -> list[list[int]]:
    """The data-parallel ranks that run every micro-batch together: those whose ranks share an
    expert-parallel group (in a pipeline stage, attention rank r is DP rank r // tp; expert rank
    r is etp rank r % etp of EP group r // (etp · ep); with context parallelism attention rank r
    is DP rank r // (tp · cp)). Each DP rank alone for a dense model."""
    dp = trainer_ranks // (parallel.tp * parallel.pp * parallel.cp)
    attention = parallel.tp * parallel.cp  # consecutive ranks of one DP rank in a stage
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
            other = first_of.setdefault(group, rank // attention)
            parent[root(rank // attention)] = root(other)
    groups: dict[int, list[int]] = {}
    for rank in range(dp):
        groups.setdefault(root(rank), []).append(rank)
    return list(groups.values())


def _pay(sizes: list[list[float]], groups: list[list[int]]) -> list[float]:
    """Per rank: its j-th micro-batch pays the largest j-th micro-batch of its lockstep group."""
    count = max(len(s) for s in sizes)
    rows = [s + [0] * (count - len(s)) for s in sizes]
    paid = [0.0] * len(sizes)
    for group in groups:
        total = sum(max(rows[r][j] for r in group) for j in range(count))
        for r in group:
            paid[r] = total
    return paid


def _pass(micro_batches: list[list[tuple[int, int]]], real: int, groups: list[list[int]], cost: CostModel
          ) -> PassCost:
    """Each rank's micro-batches as (samples, positions each is padded to: a padded micro-batch's
    longest, or a pack's whole length with ``samples`` = 1), costliest first where they run so."""
    positions = [[n * length for n, length in rank] for rank in micro_batches]
    costs = [[n * cost(length) for n, length in rank] for rank in micro_batches]
    return PassCost(micro_batches=max(len(rank) for rank in micro_batches), real=real,
                    paid=[int(p) for p in _pay(positions, groups)], paid_cost=_pay(costs, groups))


def padded_pass(positions: list[int], *, dp: int, micro_batch_size: int, pad: int, groups: list[list[int]],
                cost: CostModel) -> PassCost:
    """The trainer's padded micro-batches: contiguous shares, ``micro_batch_size`` samples each."""
    ranks = [[(len(batch), round_up(max(batch), pad)) for batch in chunk(share, micro_batch_size)]
             for share in split(positions, dp)]
    return _pass(ranks, sum(positions), groups, cost)


def packed_pass(positions: list[int], *, dp: int, budget: int, pad: int, groups: list[list[int]],
                cost: CostModel) -> PassCost:
    """The trainer's packs: its balanced shares and, on every rank, as many micro-batches as the
    rank that needs the most (``bpo_megatron.trainer.balance``, run on these lengths)."""
    costs = [cost(n) for n in positions]
    shares = balanced_shares(costs, dp)
    count = max(fewest_micro_batches([positions[i] for i in share], [costs[i] for i in share], budget)
                for share in shares)
    ranks = []
    for share in shares:
        bins = micro_batch_bins([positions[i] for i in share], [costs[i] for i in share], budget, count)
        ranks.append([(1, round_up(sum(positions[share[i]] for i in b), pad)) for b in bins])
    return _pass(ranks, sum(positions), groups, cost)


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


def estimate_batches(cfg: ExperimentConfig, *, dp: int, groups: list[list[int]], lengths: str, cost: CostModel,
                     steps: int = DEFAULT_STEPS, seed: int = DEFAULT_SEED) -> BatchEstimate:
    """Micro-batches per DP rank, imbalance and useful tokens of the padded and (with a budget)
    the packed micro-batches, for the ``lengths`` distribution (:data:`LENGTH_DISTRIBUTIONS`)."""
    distribution = LENGTH_DISTRIBUTIONS[lengths]
    max_prompt, max_new = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    pad = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1
    budget, b = cfg.trainer.max_tokens_per_micro_batch, cfg.trainer.micro_batch_size
    cp = cfg.parallel.cp
    if budget < rank_positions(max_prompt + max_new - 1, cp):
        budget = 0  # packing cannot hold the longest sample (a failed layout check says so): padded only
    rng = random.Random(seed)
    runs: dict[tuple[str, str], list[PassCost]] = {}
    drawn: list[int] = []
    for _ in range(steps):
        full = [sum(distribution.draw(rng, max_prompt, max_new)) - 1 for _ in range(cfg.responses_per_step)]
        drawn += full
        step = [rank_positions(n, cp) for n in full]  # what each sample takes of a rank's packs
        size = cfg.minibatch_size
        passes = [("minibatch", step[i:i + size]) for i in range(0, len(step), size)] + [("logprob", step)]
        for name, costs in passes:
            runs.setdefault((name, "padded"), []).append(
                padded_pass(costs, dp=dp, micro_batch_size=b, pad=pad, groups=groups, cost=cost))
            if budget and len(costs) % dp == 0:  # (else the trainer refuses the layout: a failed check says so)
                runs.setdefault((name, "packed"), []).append(
                    packed_pass(costs, dp=dp, budget=budget, pad=pad, groups=groups, cost=cost))

    def estimate(name: str, samples: int) -> PassEstimate:
        packed = runs.get((name, "packed"))
        return PassEstimate(samples=samples, padded=PassStats.of(runs[(name, "padded")]),
                            packed=PassStats.of(packed) if packed else None)

    return BatchEstimate(lengths=lengths, description=distribution.describe(max_prompt, max_new), steps=steps,
                         seed=seed, mean_positions=sum(drawn) / len(drawn),
                         minibatch=estimate("minibatch", cfg.minibatch_size),
                         logprob=estimate("logprob", cfg.responses_per_step))
