"""Benchmark: how long a training step waits for a checkpoint save, blocking against background.

Each run trains ``--steps`` steps of a Qwen3-MoE of the given sizes on gloo ranks and saves every
``--every`` steps, blocking (``TrainActor.save``) or in the background (``save(background=True)``:
the step waits while the state is staged, and for the save before it if that one is still
writing; the write and the publish happen beside the next steps). A background run's last save is
finished at its end; that wait is its own column, and in its wall time.

The modes alternate within each round (blocking, background, blocking, ...) so both see the same
machine load. The table gives, per run, each save's wait (the slowest rank's) as median and
maximum, how much of it waited for the save before, the end-of-run wait, the mean training step
(a background write shares the machine with the steps beside it) and the wall time; then the
means per mode with the ratio to blocking, and whether the last checkpoints of every run hold the
same bytes (the same training saved both ways).

The writer needs a core of its own to overlap: on 2 cores the default is one trainer rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MODES = ("blocking", "background")
MiB = 2**20


@dataclass(frozen=True)
class Settings:
    steps: int = 12
    every: int = 3
    ranks: int = 1
    rounds: int = 2
    hidden_size: int = 512
    layers: int = 4
    experts: int = 8
    vocab_size: int = 8192
    samples_per_step: int = 8

    def model(self) -> dict:
        from bpo_megatron.testing.models import qwen3_moe_config

        return qwen3_moe_config(hidden_size=self.hidden_size, intermediate_size=2 * self.hidden_size,
                                moe_intermediate_size=self.hidden_size, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=self.hidden_size // 4, num_hidden_layers=self.layers,
                                num_experts=self.experts, num_experts_per_tok=2, vocab_size=self.vocab_size,
                                max_position_embeddings=256)


@dataclass(frozen=True)
class Run:
    mode: str
    round: int
    waits_s: list[float]  # per save, the slowest rank's time in save()
    previous_s: float  # of those, waiting for the save before to finish (background only)
    final_s: float  # finishing the last save at the end of the run
    step_s: float  # mean training step
    wall_s: float
    checkpoint_mib: float
    shards: dict[str, str]  # the last checkpoint's shard files and their SHA-256


def _run_rank(settings: Settings, mode: str, root: str) -> dict:
    import torch.distributed as dist

    from bpo_megatron import testing as th
    from bpo_megatron.trainer import checkpoint

    model = settings.model()
    actor = th.build_actor(hf=model, ep=settings.ranks, lr=1e-4)
    background = mode == "background"
    waits, previous, steps = [], 0.0, []
    dist.barrier()
    start = time.perf_counter()
    for index in range(settings.steps):
        samples = th.make_samples(settings.samples_per_step, seed=index, hf=actor.hf)
        begin = time.perf_counter()
        actor.train_step(samples)
        steps.append(time.perf_counter() - begin)
        if (index + 1) % settings.every == 0:
            begin = time.perf_counter()
            actor.save(root, background=background, keep_last=1)
            waits.append(time.perf_counter() - begin)
            previous += actor.saves.waited_s if background else 0.0
    begin = time.perf_counter()
    actor.finish_saves("the benchmark run ends")
    final = time.perf_counter() - begin
    wall = time.perf_counter() - start
    actor.close()
    newest = checkpoint.select(root).path
    manifest = json.loads((newest / checkpoint.integrity.MANIFEST).read_text())
    return {"waits": waits, "previous": previous, "final": final, "step": statistics.fmean(steps), "wall": wall,
            "mib": checkpoint.checkpoint_bytes(newest) / MiB,
            "shards": {name: entry["sha256"] for name, entry in manifest.items() if name.endswith(".distcp")}}


def measure(settings: Settings, mode: str, round_: int) -> Run:
    from bpo_megatron.parallel.local_world import run_gloo_world

    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as scratch:
        ranks = run_gloo_world(_run_rank, settings.ranks, settings, mode, str(Path(scratch) / "ckpt"), timeout=3600)
    return Run(mode=mode, round=round_, waits_s=[max(w) for w in zip(*(r["waits"] for r in ranks))],
               previous_s=max(r["previous"] for r in ranks), final_s=max(r["final"] for r in ranks),
               step_s=max(r["step"] for r in ranks), wall_s=max(r["wall"] for r in ranks),
               checkpoint_mib=ranks[0]["mib"], shards=ranks[0]["shards"])


def run_rounds(settings: Settings) -> list[Run]:
    return [measure(settings, mode, r) for r in range(settings.rounds) for mode in MODES]


def format_table(runs: list[Run], settings: Settings) -> str:
    ms = 1e3
    lines = [f"{settings.ranks} gloo rank(s), Qwen3-MoE hidden {settings.hidden_size}, {settings.layers} layers, "
             f"{settings.experts} experts, vocabulary {settings.vocab_size} "
             f"(checkpoint {runs[0].checkpoint_mib:.0f} MiB); "
             f"{settings.steps} steps of {settings.samples_per_step} samples, a save every {settings.every}; "
             "modes alternating", "",
             "| round | mode | saves | step wait per save, median ms | max ms | of it for the save before, total ms "
             "| end-of-run wait ms | mean step s | wall s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.round + 1} | {r.mode} | {len(r.waits_s)} | {statistics.median(r.waits_s) * ms:.0f} | "
              f"{max(r.waits_s) * ms:.0f} | {r.previous_s * ms:.0f} | {r.final_s * ms:.0f} | {r.step_s:.2f} | "
              f"{r.wall_s:.1f} |" for r in runs]
    wait = {m: statistics.fmean(statistics.median(r.waits_s) for r in runs if r.mode == m) for m in MODES}
    wall = {m: statistics.fmean(r.wall_s for r in runs if r.mode == m) for m in MODES}
    lines += ["", "| mode | mean of median waits ms | vs blocking | mean wall s | vs blocking |",
              "|---|---:|---:|---:|---:|"]
    lines += [f"| {m} | {wait[m] * ms:.0f} | {wait[m] / wait['blocking']:.2f}× | {wall[m]:.1f} | "
              f"{wall[m] / wall['blocking']:.2f}× |" for m in MODES]
    identical = all(r.shards == runs[0].shards for r in runs) and bool(runs[0].shards)
    lines += ["", f"last checkpoints hold the same bytes in every run: {'yes' if identical else 'NO'} "
                  f"({len(runs[0].shards)} shard files compared by SHA-256)"]
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Settings()
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--every", type=int, default=defaults.every, help="save every this many steps")
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=defaults.ranks,
                        help="gloo trainer ranks (2: expert parallelism 2)")
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--experts", type=int, default=defaults.experts)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    args = build_parser(parser).parse_args(argv)
    if args.steps < args.every or args.every < 1:
        parser = parser or build_parser()
        parser.error(f"--every must be >= 1 and at most --steps ({args.steps}), got {args.every}")
    settings = Settings(steps=args.steps, every=args.every, ranks=args.ranks, rounds=args.rounds,
                        hidden_size=args.hidden_size, layers=args.layers, experts=args.experts,
                        vocab_size=args.vocab_size)
    print(format_table(run_rounds(settings), settings))
    return 0
