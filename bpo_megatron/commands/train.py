"""``bpo-megatron train CONFIG [section.key=value ...]``: run an RL experiment."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bpo-megatron train", description=__doc__)
    parser.add_argument("config", help="experiment YAML (e.g. configs/tiny_moe_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. loss.name=grpo parallel.tp=2")
    args = parser.parse_args(argv)

    from bpo_megatron.commands.common import load_or_exit

    cfg = load_or_exit("bpo-megatron train", args.config, args.overrides)
    if cfg is None:
        return 2
    from bpo_megatron.loop.rl_loop import run

    print(f"run directory: {cfg.run_dir}", flush=True)
    result = run(cfg, echo=lambda line: print(line, flush=True))
    best = result["best_step"]
    print(f"done: {result['step']} steps; best eval mean {result['best_mean']:.3f} at step {best}"
          if best is not None else f"done: {result['step']} steps", flush=True)
    return 0
