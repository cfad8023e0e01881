"""Tier A, the exact mechanism test: the policy losses on a tabular autoregressive policy.

A softmax policy over a vocabulary of V tokens writes responses of L tokens to P prompts. Its
parameters are one logit vector per (prompt, prefix) state, so J(π) = E_x E_{y~π(·|x)} R(x, y)
is computed exactly by enumerating all V^L responses: the curves carry no evaluation noise.
Training uses the project's own pieces: group-normalised advantages
(:func:`bpo_megatron.algo.group_advantages`), the loss registry and its ``seq-mean-token-mean``
aggregation (:func:`bpo_megatron.losses.policy_loss`), on groups sampled from a behaviour policy
μ; Adam updates the logit table. What makes μ differ from the π being updated is the condition:

* several minibatches per rollout batch: π drifts away from μ within a step;
* stale samples: μ is the policy of k steps before;
* engine noise: μ = softmax(logits + σ·ξ), fresh ξ ~ N(0, 1) per step and logit, and μ's own
  log-probabilities are what the loss is given (as a rollout engine reports them).

With one minibatch, fresh samples and an exact engine, every update is taken at π = μ, where every
ratio is 1 and every loss of the family is plain policy gradient: all their trajectories coincide
(the negative control, a test).

Seeds are the leading dimension of every tensor and train in one call. Each seed's loss keeps its
own denominators (the ``BatchTotals`` of one seed's minibatch), so the summed loss gives each
seed's logits exactly the gradient of its own loss, and Adam, being elementwise, steps each seed
as if it ran alone. A seed fixes the task instance (targets, initial logits) and the sampling
stream, identically for every method: methods are compared seed by seed.

    python experiments/tier_a/mechanism.py --out-dir experiments/tier_a     # the full run (bash run.sh)
    python experiments/tier_a/mechanism.py --out-dir experiments/tier_a --summarise-only   # tables + plot from its CSVs
    python experiments/tier_a/mechanism.py --conditions control stale4 --methods bpo grpo --seeds 50
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its report module sits beside it
import mechanism_report as report  # noqa: E402

from bpo_megatron.algo import group_advantages
from bpo_megatron.losses import BatchTotals, LossStatistics, PolicyLossConfig, policy_loss


@dataclass(frozen=True)
class Task:
    """The tabular problem: which responses earn reward, and what the policy knows at the start."""

    prompts: int = 32
    vocab: int = 8
    length: int = 3
    targets: int = 2  # distinct correct responses per prompt (reward 1; every other response 0)
    init_std: float = 1.0  # the initial logits are N(0, init_std²) ...
    prior: float = 2.0  # ... plus this on every target's tokens along its own prefix

    def __post_init__(self) -> None:
        if self.vocab < 2 or self.length < 1 or self.prompts < 1:
            raise ValueError(f"Task needs vocab >= 2, length >= 1 and prompts >= 1, got {self}")
        if not 1 <= self.targets < self.responses:
            raise ValueError(f"Task.targets must be in [1, {self.responses}) (vocab**length), got {self.targets}")

    @property
    def responses(self) -> int:
        return self.vocab**self.length

    def level_offset(self, t: int) -> int:
        """Index of the first state whose prefix has t tokens (states are ordered by depth)."""
        return (self.vocab**t - 1) // (self.vocab - 1)

    @property
    def states(self) -> int:
        return self.level_offset(self.length)


# J at the start, mean over 200 seeds: 0.122 for the standard task, 0.011 for the rare-success one.
STANDARD = Task()
RARE_SUCCESS = Task(prior=0.5)


@dataclass(frozen=True)
class Condition:
    minibatches: int = 1  # optimizer updates per rollout batch
    staleness: int = 0  # the responses of step t come from the policy after step t − k
    engine_noise: float = 0.0  # σ of the Gaussian noise on the sampling logits
    task: Task = STANDARD

    def __post_init__(self) -> None:
        if self.minibatches < 1 or self.staleness < 0 or self.engine_noise < 0:
            raise ValueError(f"Condition needs minibatches >= 1, staleness >= 0, engine_noise >= 0, got {self}")


CONDITIONS: dict[str, Condition] = {
    "control": Condition(),
    "minibatch8": Condition(minibatches=8),
    "stale4": Condition(staleness=4),
    "noise0.1": Condition(engine_noise=0.1),
    "noise0.3": Condition(engine_noise=0.3),
    "rare_minibatch8": Condition(minibatches=8, task=RARE_SUCCESS),
}


@dataclass(frozen=True)
class Method:
    label: str
    loss: PolicyLossConfig


METHODS: dict[str, Method] = {
    "bpo": Method("BPO", PolicyLossConfig(name="bpo")),
    "bpo_eps1e3": Method("BPO ε=1e3", PolicyLossConfig(name="bpo", bpo_eps=1e3)),
    "grpo": Method("GRPO-CH", PolicyLossConfig(name="grpo")),
    "grpo_dualclip": Method("GRPO-CH dual-clip", PolicyLossConfig(name="grpo_dualclip")),
    "cispo": Method("CISPO", PolicyLossConfig(name="cispo")),
    "dppo_tv": Method("DPPO-TV", PolicyLossConfig(name="dppo_tv")),
    "bpo_mask_r_weight": Method("BPO mask, r weight", PolicyLossConfig(name="bpo_mask_r_weight")),
    "omega_weight_grpo_mask": Method("ω weight, GRPO mask", PolicyLossConfig(name="omega_weight_grpo_mask")),
    "sapo": Method("SAPO", PolicyLossConfig(name="sapo")),
    "gspo": Method("GSPO", PolicyLossConfig(name="gspo")),
}
# compared by default; SAPO and GSPO on request (--methods)
DEFAULT_METHODS = ("bpo", "bpo_eps1e3", "grpo", "grpo_dualclip", "cispo", "dppo_tv", "bpo_mask_r_weight",
                   "omega_weight_grpo_mask")

OPTIMIZERS: dict[str, Callable[[list[torch.Tensor], float], torch.optim.Optimizer]] = {
    # the paper's betas; no weight decay, which would pull the logit table toward uniform
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98), eps=1e-8, fused=True),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
}


@dataclass(frozen=True)
class Training:
    seeds: int = 200
    steps: int = 50
    group_size: int = 8
    lr: float = 0.1  # Adam; at this rate the control reaches J ≈ 0.96 in 50 steps, short of saturation
    optimizer: str = "adam"
    seed: int = 0  # base seed: the tasks, then the sampling streams, derive from it

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Training.optimizer={self.optimizer!r} is unknown; choose one of {sorted(OPTIMIZERS)}")
        if self.seeds < 2 or self.steps < 1 or self.group_size < 2 or not self.lr > 0:
            raise ValueError(f"Training needs seeds >= 2, steps >= 1, group_size >= 2 and lr > 0, got {self}")


@dataclass(frozen=True)
class Problem:
    task: Task
    initial_logits: torch.Tensor  # [S, P, states, V], float32 (the exact returns are taken in float64)
    rewards: torch.Tensor  # [S, P, V^L]; response y has code Σ_t y_t·V^(L−1−t)


def response_tokens(codes: torch.Tensor, task: Task) -> torch.Tensor:
    """[..., L] tokens of response codes [...]."""
    powers = task.vocab ** torch.arange(task.length - 1, -1, -1)
    return torch.div(codes.unsqueeze(-1), powers, rounding_mode="floor") % task.vocab


def prefix_states(tokens: torch.Tensor, task: Task) -> torch.Tensor:
    """[..., L] state index of each token's prefix: the level's offset plus the prefix's code."""
    states = torch.empty_like(tokens)
    prefix = torch.zeros_like(tokens[..., 0])
    for t in range(task.length):
        states[..., t] = task.level_offset(t) + prefix
        prefix = prefix * task.vocab + tokens[..., t]
    return states


def make_problem(task: Task, seeds: int, seed: int) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    shape = (seeds, task.prompts)
    # distinct targets per prompt: the first `targets` entries of a random permutation of all responses
    targets = torch.rand(*shape, task.responses, generator=gen, dtype=torch.float64).argsort(-1)[..., : task.targets]
    rewards = torch.zeros(*shape, task.responses, dtype=torch.float64).scatter_(-1, targets, 1.0)
    logits = torch.randn(*shape, task.states, task.vocab, generator=gen, dtype=torch.float64) * task.init_std
    tokens = response_tokens(targets, task)  # [S, P, K, L]
    seed_idx, prompt_idx = torch.meshgrid(torch.arange(seeds), torch.arange(task.prompts), indexing="ij")
    bonus = torch.zeros_like(logits)
    bonus[seed_idx[..., None, None], prompt_idx[..., None, None], prefix_states(tokens, task), tokens] = task.prior
    return Problem(task, (logits + bonus).float(), rewards)


def log_policy(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax over the last dimension (4x faster than torch.log_softmax on rows of 8 here).
    The sampler and the trainer both take it on gathered rows, so that with the same logits the
    behaviour and the current log-probs are the same numbers, bit for bit."""
    return logits - logits.logsumexp(dim=-1, keepdim=True)


def exact_return_and_entropy(logits: torch.Tensor, problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Per seed: J = mean_x Σ_y π(y|x)·R(x, y), and the mean over prompts of the response entropy
    −Σ_y π(y|x)·log π(y|x) in nats, both by enumerating every response (in float64)."""
    task = problem.task
    logp = log_policy(logits.double())
    seq = logp[:, :, 0, :]  # [S, P, V]: log π(y_1)
    for t in range(1, task.length):
        level = logp[:, :, task.level_offset(t): task.level_offset(t + 1), :]  # [S, P, V^t, V]
        seq = (seq.unsqueeze(-1) + level).flatten(-2)  # log π(y_≤t+1), ordered by response code
    prob = seq.exp()
    return (prob * problem.rewards).sum(-1).mean(-1), -(prob * seq).sum(-1).mean(-1)


@dataclass(frozen=True)
class Rollout:
    tokens: torch.Tensor  # [S, P·G, L]
    states: torch.Tensor  # [S, P·G, L]
    log_mu: torch.Tensor  # [S, P·G, L], the behaviour policy's log-probs of the sampled tokens
    codes: torch.Tensor  # [S, P·G]


def sample(behaviour_logits: torch.Tensor, task: Task, group_size: int, gen: torch.Generator) -> Rollout:
    """G responses per prompt from μ = softmax(``behaviour_logits`` [S, P, states, V]), by inverse
    CDF on uniform draws, laid out prompt by prompt (the layout group advantages expect)."""
    seeds = behaviour_logits.shape[0]
    shape = (seeds, task.prompts, group_size)
    uniform = torch.rand(*shape, task.length, generator=gen, dtype=torch.float64)
    seed_idx = torch.arange(seeds)[:, None, None]
    prompt_idx = torch.arange(task.prompts)[None, :, None]
    tokens = torch.empty(*shape, task.length, dtype=torch.long)
    states = torch.empty_like(tokens)
    log_mu = torch.empty(*shape, task.length, dtype=behaviour_logits.dtype)
    prefix = torch.zeros(shape, dtype=torch.long)
    for t in range(task.length):
        states[..., t] = task.level_offset(t) + prefix
        rows = log_policy(behaviour_logits[seed_idx, prompt_idx, states[..., t]])  # [S, P, G, V]
        token = (uniform[..., t, None] > rows.exp().cumsum(-1)).sum(-1).clamp(max=task.vocab - 1)
        tokens[..., t] = token
        log_mu[..., t] = rows.gather(-1, token.unsqueeze(-1)).squeeze(-1)
        prefix = prefix * task.vocab + token
    flat = (seeds, task.prompts * group_size)
    return Rollout(tokens.view(*flat, -1), states.view(*flat, -1), log_mu.view(*flat, -1), prefix.view(flat))


def minibatch_loss(logits: torch.Tensor, rollout: Rollout, advantages: torch.Tensor, rows: torch.Tensor,
                   group_size: int, cfg: PolicyLossConfig) -> tuple[torch.Tensor, LossStatistics]:
    """The sum over seeds of each seed's loss on its responses ``rows`` (indices into P·G)."""
    seeds, count = logits.shape[0], rows.numel()
    length = rollout.tokens.shape[-1]
    prompt_of = torch.div(rows, group_size, rounding_mode="floor")
    # only the rows of the visited states, so the backward pass scatters into those alone
    visited = log_policy(logits[torch.arange(seeds)[:, None, None], prompt_of[None, :, None],
                                rollout.states[:, rows]])  # [S, n, L, V]
    logprobs = visited.gather(-1, rollout.tokens[:, rows].unsqueeze(-1)).squeeze(-1)  # [S, n, L]
    flat = (seeds * count, length)
    return policy_loss(logprobs.reshape(flat), rollout.log_mu[:, rows].reshape(flat),
                       advantages[:, rows].reshape(-1), torch.ones(flat, dtype=torch.bool), cfg,
                       totals=BatchTotals(tokens=float(count * length), sequences=float(count)))


@dataclass(frozen=True)
class Trajectory:
    returns: torch.Tensor  # [steps + 1, S], exact J of π before the first step and after each
    entropies: torch.Tensor  # [steps + 1, S]
    metrics: dict[str, float]  # the loss's statistics pooled over every update and seed
    seconds: float


def train(loss: PolicyLossConfig, condition: Condition, training: Training) -> Trajectory:
    start = time.perf_counter()
    task = condition.task
    problem = make_problem(task, training.seeds, training.seed)
    logits = problem.initial_logits.clone().requires_grad_()
    optimizer = OPTIMIZERS[training.optimizer]([logits], training.lr)
    stream = torch.Generator().manual_seed(training.seed + 1)
    snapshots = deque([logits.detach().clone()], maxlen=condition.staleness + 1)
    initial_return, initial_entropy = exact_return_and_entropy(logits.detach(), problem)
    returns, entropies = [initial_return], [initial_entropy]
    stats: LossStatistics | None = None
    responses = task.prompts * training.group_size
    for _ in range(training.steps):
        behaviour = snapshots[0]  # the newest policy when fresh, k steps older when stale
        if condition.engine_noise:
            behaviour = behaviour + condition.engine_noise * torch.randn(
                behaviour.shape, generator=stream, dtype=behaviour.dtype)
        rollout = sample(behaviour, task, training.group_size, stream)
        codes = rollout.codes.view(training.seeds, task.prompts, training.group_size)
        rewards = problem.rewards.gather(-1, codes).view_as(rollout.codes)  # [S, P·G]
        advantages = group_advantages(rewards.reshape(-1), training.group_size).advantages.view_as(rewards)
        order = torch.randperm(responses, generator=stream)
        for rows in order.chunk(condition.minibatches):
            value, update_stats = minibatch_loss(logits, rollout, advantages, rows, training.group_size, loss)
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            optimizer.step()
            stats = update_stats if stats is None else stats.merge(update_stats)
        snapshots.append(logits.detach().clone())
        j, h = exact_return_and_entropy(logits.detach(), problem)
        returns.append(j)
        entropies.append(h)
    return Trajectory(torch.stack(returns), torch.stack(entropies), stats.as_metrics(), time.perf_counter() - start)


def run(conditions: list[str], methods: list[str], training: Training,
        log: Callable[[str], None] = print) -> dict[tuple[str, str], Trajectory]:
    results = {}
    for condition in conditions:
        for method in methods:
            trajectory = train(METHODS[method].loss, CONDITIONS[condition], training)
            results[condition, method] = trajectory
            log(f"{condition:16s} {METHODS[method].label:22s} final J {trajectory.returns[-1].mean():.4f}  "
                f"masked {trajectory.metrics['clip_frac']:.4f}  {trajectory.seconds:.1f} s")
    return results


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="experiments/tier_a/mechanism.py", description=__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Training()
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=list(CONDITIONS))
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", type=int, default=defaults.seeds)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--optimizer", default=defaults.optimizer, choices=sorted(OPTIMIZERS))
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 suits a shared 2-core machine)")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/mechanism"),
                        help="writes per_seed.csv, runs.csv, curves.csv, tables.md and curves.png here")
    parser.add_argument("--summarise-only", action="store_true",
                        help="recompute tables.md and curves.png from the CSVs already in --out-dir; train nothing")
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    args = build_parser(parser).parse_args(argv)
    if not args.summarise_only:
        torch.set_num_threads(args.threads)
        training = Training(seeds=args.seeds, steps=args.steps, group_size=args.group_size, lr=args.lr,
                            optimizer=args.optimizer, seed=args.seed)
        results = run(args.conditions, args.methods, training)
        labels = {name: METHODS[name].label for name in args.methods}
        report.write_results(args.out_dir, report.results_from_trajectories(results, labels))
    results = report.read_results(args.out_dir)
    tables = report.markdown_tables(results)
    (args.out_dir / "tables.md").write_text(tables)
    plotted = report.plot_curves(results, args.out_dir / "curves.png")
    print(tables)
    print(f"wrote {args.out_dir}/" + ("" if plotted else " (no plot: matplotlib is not installed)"))
    return 0


__all__ = ["CONDITIONS", "Condition", "METHODS", "Method", "Problem", "Task", "Training", "Trajectory",
           "exact_return_and_entropy", "main", "make_problem", "minibatch_loss", "run", "sample", "train"]


if __name__ == "__main__":
    sys.exit(main())
