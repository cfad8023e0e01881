"""``bpo-megatron eval CONFIG [overrides] [--checkpoint CKPT | --hf-dir DIR]``: Avg@k of a policy.

Evaluates on the config's ``eval.datasets`` with the embedded engine, in this process. The
policy is a trainer checkpoint (exported to Hugging Face format on the fly), a Hugging Face
directory, or by default the run's newest checkpoint (else ``model.path``).
"""

from __future__ import annotations

import argparse
import tempfile


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bpo-megatron eval", description=__doc__)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="a trainer checkpoint (root with 'latest' or a step directory)")
    source.add_argument("--hf-dir", help="a Hugging Face model directory")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    from bpo_megatron.commands.common import load_or_exit

    cfg = load_or_exit("bpo-megatron eval", args.config, args.overrides)
    if cfg is None:
        return 2
    from bpo_megatron.data.rewards import reward_fn
    from bpo_megatron.data.tokenizer import load_tokenizer
    from bpo_megatron.eval.avg_at_k import evaluate
    from bpo_megatron.loop.run import checkpoint_root
    from bpo_megatron.rollout.hf_engine import HFEngine
    from bpo_megatron.trainer import checkpoint

    with tempfile.TemporaryDirectory(prefix="bpo-eval-") as scratch:
        ckpt = args.checkpoint or (None if args.hf_dir else _newest(checkpoint_root(cfg), checkpoint))
        if ckpt:
            from bpo_megatron.convert import convert_mcore_to_hf

            hf_dir = f"{scratch}/hf"
            convert_mcore_to_hf(ckpt, hf_dir)
            label = str(checkpoint.resolve(ckpt))
        else:
            hf_dir = args.hf_dir or cfg.model.path
            label = hf_dir
        engine = HFEngine(hf_dir, capture_routing=False, threads=args.threads)
        try:
            result = evaluate(engine.generate, load_tokenizer(cfg.model.tokenizer or cfg.model.path),
                              reward_fn(cfg.data.reward), cfg, step=0)
        finally:
            engine.shutdown()
    print(f"policy: {label}")
    for name, value in result.scores.items():
        print(f"  {name:<24} Avg@{cfg.eval.k} = {100 * value:.1f}%")
    print(f"  {'mean':<24} Avg@{cfg.eval.k} = {100 * result.mean:.1f}%")
    return 0


def _newest(root, checkpoint) -> str | None:
    return str(root) if checkpoint.latest_step(root) is not None else None
