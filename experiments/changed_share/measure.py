"""The changed share of bf16 weights per weight sync, measured in this project's RL loop.

``python experiments/changed_share/measure.py --out CSV [--only RUN ...]`` trains each
pre-registered run of ``RUNS`` (README.md beside this file) and, after every weight sync, asks the
embedded engine for its weights: each tensor is rounded to bf16 (what a bf16 engine holds) and
compared with the bf16 tensor of the sync before, bit for bit. One CSV row per sync and tensor kind
(``bpo_megatron.weight_sync.delta_estimate.tensor_kind``): elements, elements whose bf16 bits
differ, and the bytes a delta sync of those tensors would send (``delta_estimate.bucket_wire_bytes``,
one bucket per kind). A run's rows are appended when it ends, and a run already in the CSV is
skipped, so a stopped call continues where it stopped; ``table.py`` rebuilds the table from it.

The comparison runs inside the engine's actor (Ray's ``__ray_call__``): nothing leaves it but the
counts, and the previous bf16 copy stays there between syncs. The first sync (the start's
weights) has no predecessor and is not a row. All runs share one Ray instance, started once (its
start is retried: on a loaded machine Ray's own 30-second start-up wait can run out).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

SWEEP = ("1.0e-6", "1.0e-5", "3.0e-5", "1.0e-4", "2.0e-4")
# run name -> (recipe, overrides): the pre-registered runs, in the order they run
RUNS = {
    **{f"tier_b_lr{lr}": ("experiments/tier_b/rl.yaml", [f"optimizer.lr={lr}"]) for lr in SWEEP},
    **{f"tier_c_lr{lr}": ("experiments/tier_c/rl.yaml", [f"optimizer.lr={lr}"]) for lr in ("1.0e-4", "2.0e-4")},
    **{f"tiny_lr{lr}": ("configs/tiny_moe_cpu.yaml", [f"optimizer.lr={lr}"]) for lr in (*SWEEP, "3.0e-4")},
}
# every run: 6 RL steps (5 measured syncs), no evaluation, one checkpoint at the end
COMMON = ["eval.every=0", "eval.at_start=false", "checkpoint.every=0"]
RAY_START_ATTEMPTS = 5
FIELDS = ("run", "config", "lr", "step", "updates_per_step", "kind", "elements", "changed", "dense_bytes",
          "delta_bytes")


def _engine_counts(worker) -> dict[str, tuple[int, int]]:
    """Runs in the engine's actor: per tensor kind, (elements, changed bf16 elements) since the
    last call; the first call only records."""
    import torch

    from bpo_megatron.weight_sync.delta_estimate import tensor_kind

    held = getattr(worker, "_changed_share_previous", None)
    current = {name: tensor.detach().to(torch.bfloat16).clone() for name, tensor in worker.engine.named_hf_weights()}
    worker._changed_share_previous = current
    if held is None:
        return {}
    counts: dict[str, list[int]] = {}
    for name, tensor in current.items():
        before = held[name]
        # bit patterns, not values: -0.0 against 0.0 and NaN payloads are changes a delta must send
        changed = int((tensor.view(torch.int16) != before.view(torch.int16)).sum())
        entry = counts.setdefault(tensor_kind(name), [0, 0])
        entry[0] += tensor.numel()
        entry[1] += changed
    return {kind: (elements, changed) for kind, (elements, changed) in counts.items()}


def _start_ray(cluster) -> None:
    from bpo_megatron.orchestration.cluster import start_ray

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            start_ray(cluster, cpus_needed=8)
            return
        except Exception as exc:  # Ray's start-up wait is fixed at 30 s inside Ray
            print(f"measure.py: Ray did not start (attempt {attempt} of {RAY_START_ATTEMPTS}): {exc}", flush=True)
    raise SystemExit(f"measure.py: Ray did not start in {RAY_START_ATTEMPTS} attempts")


def measure_run(name: str, config: str, overrides: list[str], out: Path) -> int:
    """Train one run, measuring every sync; append its rows to ``out``; return the rows."""
    import ray

    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.loop import session
    from bpo_megatron.loop.preflight import prepare
    from bpo_megatron.loop.rl_loop import execute
    from bpo_megatron.weight_sync.delta_estimate import bucket_wire_bytes

    cfg = load_experiment(config, overrides)
    if cfg.rollout.engine != "hf":
        raise SystemExit(f"measure.py: {name}: rollout.engine must be hf (the embedded engine), got "
                         f"{cfg.rollout.engine!r}")
    rows: list[dict] = []
    original = session.sync_weights
    syncs = [0]

    def measured_sync(trainer, engines, **kwargs):
        result = original(trainer, engines, **kwargs)
        # one engine suffices: every engine holds the same weights after a sync
        counts = ray.get(engines.workers[0].__ray_call__.remote(_engine_counts))
        for kind, (elements, changed) in sorted(counts.items()):
            rows.append({"run": name, "config": config, "lr": cfg.optimizer.lr, "step": syncs[0],
                         "updates_per_step": cfg.train.minibatches_per_step, "kind": kind, "elements": elements,
                         "changed": changed, "dense_bytes": 2 * elements,
                         "delta_bytes": bucket_wire_bytes(elements, changed)})
        syncs[0] += 1
        return result

    session.sync_weights = measured_sync
    try:
        execute(prepare(cfg), echo=lambda line: print(line, flush=True))
    finally:
        session.sync_weights = original
    new_file = not out.exists()
    with out.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        if new_file:
            writer.writeheader()
        writer.writerows(rows)
    print(f"{name}: {len(rows)} rows ({syncs[0] - 1} syncs measured) appended to {out}", flush=True)
    return len(rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="CSV to append to")
    parser.add_argument("--only", nargs="+", choices=sorted(RUNS), help="these runs (default: all of RUNS)")
    parser.add_argument("--steps", type=int, default=6, help="RL steps a run (default 6: 5 measured syncs)")
    parser.add_argument("--root", default="runs/changed_share", help="where the runs' directories go")
    args = parser.parse_args(argv)
    out = Path(args.out)
    done = set()
    if out.exists():
        with out.open() as handle:
            done = {row["run"] for row in csv.DictReader(handle)}
    todo = [name for name in (args.only or RUNS) if name not in done]
    if not todo:
        print(f"every run is in {out} already")
        return 0

    import shutil

    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.orchestration.cluster import stop_ray

    _start_ray(load_experiment(RUNS[todo[0]][0]).cluster)
    try:
        for name in todo:
            config, overrides = RUNS[name]
            run_dir = Path(args.root) / name
            shutil.rmtree(run_dir, ignore_errors=True)  # a run stopped midway starts over
            measure_run(name, config, [*overrides, *COMMON, f"train.steps={args.steps}",
                                       f"logging.run_dir={run_dir}"], out)
    finally:
        stop_ray()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
