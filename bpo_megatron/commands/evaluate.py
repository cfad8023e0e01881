"""``bpo-megatron eval CONFIG [overrides] [--checkpoint CKPT | --hf-dir DIR]``: Avg@k of a policy.

Evaluates on the config's ``eval.datasets`` with the run's engine (``rollout.engine`` and its
section), built in this process; an engine that cannot be built here is refused by name before
anything loads (exit 2). The policy is a trainer checkpoint (exported to Hugging Face format on the fly), a Hugging Face
directory, or by default the run's newest checkpoint (a pretrained ``model.path`` when the run
has none). The evaluation sets and the checkpoint are checked before the model loads;
``--check`` stops there. An evaluation on which a user reward failed beyond
``data.reward_max_failed_frac`` measured nothing and exits 1 saying so.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bpo-megatron eval", description=__doc__)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="a trainer checkpoint (root with 'latest' or a step directory)")
    source.add_argument("--hf-dir", help="a Hugging Face model directory")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--check", action="store_true", help="check the config, data and policy, then exit")
    args = parser.parse_args(argv)
    prog = "bpo-megatron eval"

    from bpo_megatron.commands.common import REFUSED, load_or_exit

    cfg = load_or_exit(prog, args.config, args.overrides)
    if cfg is None:
        return REFUSED
    from bpo_megatron.config import ConfigError

    try:
        sets, tokenizer, policy, agent = _prepare(cfg, args)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return REFUSED
    kind, location = policy
    if args.check:
        print(f"config ok: would evaluate {kind} {location} on "
              + ", ".join(f"{s.name} ({len(s.prompts)} questions)" for s in sets))
        return 0

    from bpo_megatron.data.rewards import reward_fn
    from bpo_megatron.eval.avg_at_k import evaluate
    from bpo_megatron.rollout.agents import with_agent
    from bpo_megatron.rollout.engine import EngineContext

    with tempfile.TemporaryDirectory(prefix="bpo-eval-") as scratch:
        hf_dir = location
        if kind == "checkpoint":
            from bpo_megatron.convert import convert_mcore_to_hf

            hf_dir = f"{scratch}/hf"
            convert_mcore_to_hf(location, hf_dir)
        engine = cfg.rollout.spec.build(cfg.rollout.options,
                                        EngineContext(model_dir=hf_dir, index=0, routing=None, threads=args.threads))
        rollouts = with_agent(engine, agent, tokenizer)
        try:
            result = evaluate(rollouts.generate, sets, tokenizer, reward_fn(cfg.data.reward, cfg.data), cfg, step=0)
        finally:
            engine.shutdown()
    from bpo_megatron.commands.common import FAILED

    unscored = result.unscored(cfg.data.reward, cfg.data.reward_max_failed_frac)
    if unscored is not None:  # failures scored as wrong answers: no measurement of the policy
        print(f"{prog}: {location} was not measured: {unscored}; fix the reward and evaluate again", file=sys.stderr)
        return FAILED
    print(f"policy: {location}")
    for name, value in result.scores.items():
        failed = result.reward_failed.get(name)
        print(f"  {name:<24} Avg@{cfg.eval.k} = {100 * value:.1f}%"
              + (f" ({failed} responses the reward failed on, scored wrong)" if failed else ""))
    print(f"  {'mean':<24} Avg@{cfg.eval.k} = {100 * result.mean:.1f}%")
    return 0


def _prepare(cfg, args):
    """The screened evaluation sets, the tokenizer, the policy (kind, location) to evaluate and
    the agent (rollout.agent; None: single-turn), or RunRefused: evaluation sets, tokenizer,
    agent and checkpoint checked before any model loads."""
    from bpo_megatron.eval.avg_at_k import load_eval_sets
    from bpo_megatron.loop.preflight import check_agent, check_reward, load_run_tokenizer, prompt_format
    from bpo_megatron.loop.run_dir import RunRefused, checkpoint_root
    from bpo_megatron.trainer import checkpoint

    if not cfg.eval.datasets:
        raise RunRefused("eval.datasets is empty: name the evaluation sets (e.g. eval.datasets=[aime24])")
    _check_engine(cfg)
    hf = cfg.hf_config()
    tokenizer = load_run_tokenizer(cfg, hf)
    try:
        sets = load_eval_sets(cfg.eval, cfg.data.root, prompt_format(cfg, tokenizer),
                              skip_bad=cfg.data.on_bad_record == "skip")
    except (OSError, ValueError) as exc:
        raise RunRefused(str(exc)) from exc
    check_reward(cfg, sets[0].prompts[0].problem, what="the first evaluation question")
    agent, _ = check_agent(cfg, tokenizer, sets[0].prompts[0].problem, what="the first evaluation question")
    if args.hf_dir:
        if not (Path(args.hf_dir) / "config.json").is_file():
            raise RunRefused(f"--hf-dir {args.hf_dir} is not a Hugging Face model directory (no config.json)")
        return sets, tokenizer, ("Hugging Face model", args.hf_dir), agent
    root = Path(args.checkpoint) if args.checkpoint else checkpoint_root(cfg)
    try:
        chosen = checkpoint.select(root)
    except checkpoint.DamagedCheckpoint as exc:
        raise RunRefused(str(exc)) from exc
    if chosen.path is not None:
        return sets, tokenizer, ("checkpoint", str(chosen.path)), agent
    if args.checkpoint:
        raise RunRefused(f"--checkpoint {args.checkpoint}: no checkpoint there (a step directory with "
                         f"{checkpoint.STATE_FILE}, or a root holding them)")
    if cfg.model.init == "random":
        raise RunRefused(f"the run has no checkpoint yet ({root}) and model.init=random has no trained weights to "
                         "evaluate: train first, or pass --checkpoint or --hf-dir")
    return sets, tokenizer, ("pretrained model.path", cfg.model.path), agent


def _check_engine(cfg) -> None:
    """The run's engine can be built in this process: the library it runs in process imports
    (``EngineSpec.library``; its options were checked with the config), else refused by name
    before any model loads. A server's engine starts its server from its own settings
    (``launcher``)."""
    import importlib.util

    from bpo_megatron.loop.run_dir import RunRefused

    engine = cfg.rollout.engine
    library = cfg.rollout.spec.library
    if library and importlib.util.find_spec(library) is None:
        raise RunRefused(f"rollout.engine={engine} needs the {library} package, which this Python lacks: evaluate with "
                         "rollout.engine=hf (the embedded engine), or where it is installed")
