"""Command line of the checkpoint converter (``bpo-megatron convert``).

    bpo-megatron convert hf-to-mcore --hf-dir HF --out CKPT [--tp N --ep N --pp N]
    bpo-megatron convert mcore-to-hf --ckpt CKPT --out HF [--hf-config HF_OR_CONFIG_JSON]

Exit codes: 0 done, 2 refused input (bad arguments, missing files or tensors, wrong shapes, a
config that disagrees with the checkpoint; the message names each problem), 1 the conversion
itself failed.
"""

from __future__ import annotations

import argparse
import sys

from bpo_megatron.convert.world import DEFAULT_TIMEOUT_S
from bpo_megatron.weights.safetensors_io import DEFAULT_MAX_SHARD_BYTES, parse_size


def _layout_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    for name, help_text in (("tp", "tensor"), ("ep", "expert"), ("pp", "pipeline")):
        parser.add_argument(f"--{name}", type=int, default=1,
                            help=f"{help_text}-parallel size {what} (default 1)")
    parser.add_argument("--etp", type=int, default=None,
                        help="expert tensor-parallel size (default: 1 with --ep > 1, else --tp)")


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Convert checkpoints between Hugging "
                                     "Face (safetensors) and Megatron-Core (trainer checkpoints).")
    commands = parser.add_subparsers(dest="direction", required=True)

    to_mcore = commands.add_parser("hf-to-mcore", help="Hugging Face directory → trainer checkpoint")
    to_mcore.add_argument("--hf-dir", required=True, help="directory with config.json and *.safetensors")
    to_mcore.add_argument("--out", required=True, help="checkpoint root to create")
    _layout_arguments(to_mcore, "to convert in (the checkpoint loads under any layout)")

    to_hf = commands.add_parser("mcore-to-hf", help="trainer checkpoint → Hugging Face directory")
    to_hf.add_argument("--ckpt", required=True, help="checkpoint root (follows 'latest') or step directory")
    to_hf.add_argument("--out", required=True, help="Hugging Face directory to create")
    to_hf.add_argument("--hf-config", default=None,
                       help="config.json (or a directory with one, and tokenizer files) to write; "
                            "must describe the checkpoint's network. Default: the checkpoint's own")
    to_hf.add_argument("--tokenizer-dir", default=None, help="copy tokenizer files from here")
    to_hf.add_argument("--max-shard-size", default=str(DEFAULT_MAX_SHARD_BYTES), type=parse_size,
                       help="largest safetensors shard, e.g. 5GB (default) or 500MB")
    _layout_arguments(to_hf, "to load the checkpoint in (spreads memory over processes)")

    for sub in (to_mcore, to_hf):
        sub.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
        sub.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                         help="seconds before the conversion is abandoned")
        sub.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None, prog: str = "bpo-megatron convert") -> int:
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.parallel.local_world import GlooWorldError

    args = _parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    try:
        parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
        common = dict(parallel=parallel, overwrite=args.overwrite, timeout=args.timeout,
                      progress=not args.no_progress)
        if args.direction == "hf-to-mcore":
            from bpo_megatron.convert.hf_to_mcore import convert_hf_to_mcore

            out = convert_hf_to_mcore(args.hf_dir, args.out, **common)
        else:
            from bpo_megatron.convert.mcore_to_hf import convert_mcore_to_hf

            out = convert_mcore_to_hf(args.ckpt, args.out, hf_config=args.hf_config,
                                      tokenizer_dir=args.tokenizer_dir,
                                      max_shard_bytes=args.max_shard_size, **common)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except GlooWorldError as error:
        print(f"error: the conversion failed:\n{error}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
