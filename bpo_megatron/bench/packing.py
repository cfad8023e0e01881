"""Benchmark: padded against packed micro-batches on RL's long-tailed lengths, side by side.

One gloo world of DP=2 ranks that form one expert-parallel group (EP=2: every micro-batch meets
in the experts' all-to-all, so the ranks run each micro-batch in lockstep) trains the same
minibatch of a small Qwen3-MoE (random weights, R3 replay) three ways, interleaved round by round:

* padded, 1 sample per micro-batch (what the 30B recipes did before the token budget);
* padded, 4 samples per micro-batch;
* packed into micro-batches of at most ``--budget`` input positions, balanced over the ranks
  (``trainer.max_tokens_per_micro_batch``).

The lengths are the paper's mix scaled down by ``--scale`` (ratios kept): prompts uniform in
50–300 tokens, responses log-uniform in 256–16,384 with 30% at the cap.

Columns: micro-batches per rank; the *useful fraction* — real input positions over the positions
the ranks pay for, where a padded micro-batch pays its samples × its longest one, a packed one its
positions, and, in lockstep, every rank pays what the largest micro-batch of its group costs;
the median optimizer-step time over ``--rounds`` rounds and its ratio to padded b=1.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.testing.models import qwen3_moe_config

MODEL: dict[str, Any] = qwen3_moe_config(
    router_aux_loss_coef=0.0,
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
    vocab_size=1024, max_position_embeddings=4096)
PAPER = {"prompt": (50, 300), "response": (256, 16_384), "at_cap": 0.3}
RANKS = 2  # data-parallel ranks, one expert-parallel group


@dataclass(frozen=True)
class Settings:
    samples: int = 32  # one minibatch, split over the two ranks
    scale: float = 1 / 32  # of the paper's lengths
    budget: int = 0  # packed micro-batch positions (0: room for two samples at the caps)
    rounds: int = 3  # timed rounds (each mode once per round, after one warm-up round)
    seed: int = 0

    @property
    def longest(self) -> int:
        return math.ceil(PAPER["prompt"][1] * self.scale) + math.ceil(PAPER["response"][1] * self.scale) - 1

    @property
    def packed_budget(self) -> int:
        return self.budget or 2 * (self.longest + 1)


def paper_lengths(settings: Settings) -> list[tuple[int, int]]:
    """(prompt, response) token counts of the paper's mix, scaled."""
    rng = random.Random(settings.seed)
    low, cap = (max(1, math.ceil(x * settings.scale)) for x in PAPER["response"])
    pairs = []
    for _ in range(settings.samples):
        prompt = max(1, round(rng.uniform(*PAPER["prompt"]) * settings.scale))
        response = cap if rng.random() < PAPER["at_cap"] else \
            max(1, round(math.exp(rng.uniform(math.log(low), math.log(cap)))))
        pairs.append((prompt, response))
    return pairs


def make_samples(settings: Settings, hf) -> list:
    from bpo_megatron.trainer.samples import TrainSample

    gen = torch.Generator().manual_seed(settings.seed)
    samples = []
    for i, (prompt, response) in enumerate(paper_lengths(settings)):
        n = prompt + response
        routing = torch.rand(n - 1, len(hf.moe_layers), hf.num_experts, generator=gen).argsort(dim=-1)
        samples.append(TrainSample(tokens=torch.randint(0, hf.vocab_size, (n,), generator=gen), response_start=prompt,
                                   rollout_logprobs=-torch.rand(response, generator=gen) - 1.0,
                                   advantage=1.0 if i % 2 else -1.0,
                                   routed_experts=routing[..., :hf.num_experts_per_tok].to(torch.uint8)))
    return samples


MODES = {"padded b=1": {"micro_batch_size": 1}, "padded b=4": {"micro_batch_size": 4}, "packed": {}}


def _micro_batch_positions(samples: list, mode: str, settings: Settings, cost) -> list[list[int]]:
    """Per rank, the positions each of its micro-batches pays, as the trainer batches them."""
    from bpo_megatron.trainer.balance import data_parallel_shares, fewest_micro_batches, micro_batch_bins
    from bpo_megatron.trainer.samples import chunk, split

    lengths = [s.tokens.numel() - 1 for s in samples]
    if mode != "packed":
        size = MODES[mode]["micro_batch_size"]
        return [[len(group) * max(lengths[i] for i in group) for group in chunk(share, size)]
                for share in split(list(range(len(samples))), RANKS)]
    budget = settings.packed_budget
    shares = data_parallel_shares(samples, RANKS, budget=budget, cost=cost)
    costs = [cost(n) for n in lengths]
    count = max(fewest_micro_batches([lengths[i] for i in s], [costs[i] for i in s], budget) for s in shares)
    paid = []
    for share in shares:
        mine, their_costs = [lengths[i] for i in share], [costs[i] for i in share]
        paid.append([sum(mine[j] for j in bin_) for bin_ in micro_batch_bins(mine, their_costs, budget, count)])
    return paid


def useful_fraction(paid: list[list[int]], useful: int) -> float:
    """Real positions over paid ones: every rank pays the lockstep maximum of each micro-batch."""
    rounds = max(len(rank) for rank in paid)
    lockstep = sum(max(rank[k] if k < len(rank) else 0 for rank in paid) for k in range(rounds))
    return useful / (lockstep * len(paid))


def _rank(settings: Settings) -> dict[str, Any]:
    import torch.distributed as dist

    from bpo_megatron import testing
    from bpo_megatron.models import HFModelConfig

    hf = HFModelConfig.load(MODEL)
    torch.manual_seed(0)
    actor = testing.build_actor(hf, ep=RANKS, replay=True, loss="bpo", lr=1e-6, micro_batch_size=1)
    samples = make_samples(settings, hf)
    configs = {mode: replace(actor.trainer_cfg, micro_batch_size=options.get("micro_batch_size", 1),
                             max_tokens_per_micro_batch=0 if options else settings.packed_budget)
               for mode, options in MODES.items()}
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    micro_batches: dict[str, float] = {}
    for round_ in range(settings.rounds + 1):  # the first round warms up
        for mode, trainer_cfg in configs.items():
            actor.trainer_cfg = trainer_cfg
            dist.barrier()
            start = time.perf_counter()
            metrics = actor.train_step(samples)
            if round_:
                seconds[mode].append(time.perf_counter() - start)
            micro_batches[mode] = metrics["num_micro_batches"]
    actor.close()
    if dist.get_rank():
        return {}
    useful = sum(s.tokens.numel() - 1 for s in samples)
    paid = {mode: _micro_batch_positions(samples, mode, settings, actor.cost) for mode in MODES}
    return {"useful_positions": useful, "lengths": [s.tokens.numel() - 1 for s in samples],
            "rows": {mode: {"micro_batches": micro_batches[mode], "useful": useful_fraction(paid[mode], useful),
                            "step_s": statistics.median(seconds[mode])} for mode in MODES}}


def measure(settings: Settings) -> dict[str, Any]:
    return run_gloo_world(_rank, RANKS, settings, timeout=3600.0)[0]


def format_table(result: dict[str, Any], settings: Settings) -> str:
    lengths = result["lengths"]
    rows = result["rows"]
    base = rows["padded b=1"]["step_s"]
    lines = [f"{settings.samples} samples (the paper's length mix × {settings.scale:g}: {min(lengths)}–{max(lengths)} "
             f"input positions, mean {statistics.fmean(lengths):.0f}), DP=2 ranks in one EP=2 group, packed budget "
             f"{settings.packed_budget} positions; step time: median of {settings.rounds} rounds",
             "", "| batching | micro-batches per rank | useful fraction | step time (s) | vs padded b=1 |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {mode} | {row['micro_batches']:.0f} | {row['useful']:.3f} | {row['step_s']:.3f} | "
              f"{row['step_s'] / base:.2f} |" for mode, row in rows.items()]
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Settings()
    parser.add_argument("--samples", type=int, default=defaults.samples)
    parser.add_argument("--scale", type=float, default=defaults.scale)
    parser.add_argument("--budget", type=int, default=defaults.budget)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    args = build_parser(parser).parse_args(argv)
    settings = Settings(samples=args.samples, scale=args.scale, budget=args.budget, rounds=args.rounds, seed=args.seed)
    print(format_table(measure(settings), settings))
    return 0
