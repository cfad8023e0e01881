"""The RL loop itself: a few steps of ``configs/qwen3_moe_1gpu.yaml`` through ``bpo-megatron train``
(Ray, one trainer rank and the embedded engine colocated on one device, the offload phases, R3,
packed micro-batches, the weight sync, a checkpoint), in a subprocess with a bounded wait, judged
from what the run writes: its ``metrics.jsonl`` and its checkpoint.

On a GPU the recipe runs as written (the kit's throughput model, bf16); on a CPU (the CPU profile)
with the CPU demo's tiny model in fp32. Reported per step (:mod:`bpo_megatron.gpu_smoke.loop_steps`):
the time of each phase (``time/<phase>_s``: rollout, sync, train, and the driver's own; together
they must make up the step) and, apart from them, the weight push, the trainer's offload and onload
and the engines' resume; generated tokens per second per device (end to end, and the rollout
phase's), the routing agreement (the trainer's own routing against the engine's recorded one on a
few responses: what R3 replaces) and the mean |log π − log μ| of the step's update (trainer against
engine: one minibatch per step, so the update's weights are those that sampled the batch). The
steady state: the median of the steps from the third on.

Where the engine runs is found first, as the loop builds it (the recipe's engine options through
the hf engine's spec, ``rollout/hf/spec.py``, on a tiny model): on a GPU it must be the GPU, with
the decode path the recipe asks for.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bpo_megatron.gpu_smoke.cli import BUDGET_ENV  # the check's limit, set by the kit
from bpo_megatron.gpu_smoke.loop_steps import judge, step_rows
from bpo_megatron.gpu_smoke.profiles import Profile
from bpo_megatron.gpu_smoke.report import Outcome

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "configs" / "qwen3_moe_1gpu.yaml"
MODELS = ROOT / "configs" / "models"
LOG_TAIL = 6000  # characters of the run's output kept in the report when it fails
REPORT_MARGIN_S = 20.0  # of the check's limit, kept for reading the run and writing the outcome
RAY_STAGE_ENV = "BPO_RAY_STAGE"  # "missing": tools/gpu/round.sh found no staged Ray wheel


def ray_missing() -> str | None:
    """Why Ray cannot be imported here (None: it can)."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:  # Ray itself, or one of its own dependencies (jsonschema, ...)
        return f"{type(exc).__name__}: {exc}"
    return None


def _not_run(why: str) -> Outcome:
    out = Outcome("rl_loop")
    if os.environ.get(RAY_STAGE_ENV) == "missing":
        out.error = ("not run: Ray not staged. The loop runs its actors on Ray, which the GPU image lacks; its wheel "
                     "is larger than one call carries, so `bash tools/gpu/stage.sh` (call 1, carry "
                     ".gpu-bundle-stage) leaves part of it under /tmp and `bash tools/gpu/round.sh OUT` (call 2, carry "
                     f".gpu-bundle) joins and installs it; call 1 did not run on this machine ({why})")
    else:
        out.error = (f"not run: Ray cannot be imported ({why}). `bpo-megatron train` runs its actors on Ray "
                     "(pip install 'ray[default]'; on a GPU machine without a package registry: "
                     "tools/gpu/build_bundle.sh here, then tools/gpu/stage.sh and tools/gpu/round.sh there, "
                     "see docs/gpu-validation.md)")
    return out


# the loop's line after each save (loop/session.py)
SAVED = re.compile(r"saved the checkpoint of step \d+: ([0-9.]+) GB in ([0-9.]+) s")


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return text[-LOG_TAIL:]


def _train(overrides: list[str], log: Path, limit_s: float) -> tuple[int | None, float]:
    """``bpo-megatron train RECIPE overrides``, output to ``log``; the exit status (None: still
    running at ``limit_s``, then stopped) and the wall time. It stays in this check's process
    group, so the kit's kill at the check's limit ends it too; Ray's own processes end with the
    driver that started them."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "bpo_megatron.cli", "train", str(RECIPE), *overrides]
    start = time.perf_counter()
    with log.open("w") as sink:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            return process.wait(timeout=max(limit_s, 1.0)), time.perf_counter() - start
        except subprocess.TimeoutExpired:
            process.terminate()  # the driver stops Ray and releases the run directory
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            return None, time.perf_counter() - start
        finally:
            if process.poll() is None:
                process.kill()


def _engine_placement(cfg) -> tuple[str, str]:
    """Where the loop's engine build puts the embedded engine, and the decode path it resolves to
    there: the recipe's engine options built on a tiny model, as the engine actor builds them."""
    import tempfile

    import torch

    from bpo_megatron.gpu_smoke.profiles import CPU
    from bpo_megatron.rollout.engine import EngineContext
    from bpo_megatron.testing import random_model_dir

    if cfg.rollout.engine != "hf":
        return "-", "-"
    with tempfile.TemporaryDirectory(prefix="rl-loop-probe-") as scratch:
        model_dir = random_model_dir(CPU.small_model, Path(scratch) / "m", seed=0)
        engine = cfg.rollout.spec.build(cfg.rollout.options, EngineContext(model_dir=str(model_dir), index=0,
                                                                           routing=None, colocated=True))
        try:
            return next(engine.model.parameters()).device.type, engine.decode_path
        finally:
            engine.shutdown()
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the run's engine and trainer get the device whole


def run(profile: Profile, workdir: Path) -> Outcome:
    if (why := ray_missing()) is not None:
        return _not_run(why)
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.observability.metrics import read_metrics
    from bpo_megatron.trainer import checkpoint

    out = Outcome("rl_loop")
    run_dir = workdir / "rl_loop"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run (one left here would be resumed)
    overrides = [o.format(models=MODELS) for o in profile.loop_overrides]
    overrides += [f"train.steps={profile.loop_steps}", f"logging.run_dir={run_dir}", "logging.progress=false"]
    cfg = load_experiment(RECIPE, overrides)  # refused here, naming the setting, before anything starts
    device, decode = _engine_placement(cfg)
    out.numbers.update(engine_device=device, engine_decode_path=decode)
    if profile.device == "cuda":
        out.require(device == "cuda", f"the loop builds the embedded engine on the GPU (got {device})")
    limit = float(os.environ.get(BUDGET_ENV, 900)) - REPORT_MARGIN_S
    log = workdir / "rl_loop.log"
    status, wall = _train(overrides, log, limit)
    out.numbers.update(recipe=str(RECIPE.relative_to(ROOT)), overrides=" ".join(overrides[:-2]) or "-",
                       exit_status="killed at the limit" if status is None else status, wall_s=wall)
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    devices = cfg.cluster.trainer_ranks if cfg.cluster.colocate else (
        cfg.cluster.trainer_ranks + cfg.rollout.num_engines * max(1, int(cfg.cluster.gpus_per_engine)))
    responses = cfg.train.prompts_per_step * cfg.rollout.group_size
    table = step_rows(records, responses=responses, devices=devices)
    out.tables["per step"] = table
    chosen = None
    try:
        chosen = checkpoint.select(run_dir / "checkpoints").path
    except (OSError, ValueError) as exc:  # DamagedCheckpoint is a ValueError
        out.notes.append(f"checkpoint: {exc}")
    if status != 0 or len(table) < profile.loop_steps:
        ended = f"did not finish within {limit:.0f} s" if status is None else f"exited with status {status}"
        out.error = (f"`bpo-megatron train` {ended} after {len(table)} of {profile.loop_steps} steps; the tail of "
                     f"its output ({log}):\n{_tail(log)}")
    if table:
        judge(out, table, profile, exited=status, devices=devices, responses=responses,
              precision=f"the {cfg.model.options.params_dtype} trainer with R3 against the "
                        f"{cfg.rollout.options.dtype} engine")
    saves = [(float(gb), float(seconds)) for gb, seconds in SAVED.findall(log.read_text(errors="replace"))] \
        if log.is_file() else []
    if saves:  # where a run's wall time goes beyond its steps: the saves, and the rest (start-up, shutdown)
        out.numbers.update(checkpoint_gb=saves[-1][0], checkpoint_save_s=sum(s for _, s in saves),
                           outside_steps_and_saves_s=wall - sum(row["step_s"] for row in table)
                           - sum(s for _, s in saves))
    out.require(chosen is not None and checkpoint.step_of(chosen) == profile.loop_steps,
                f"a checkpoint of step {profile.loop_steps} was written ({chosen})")
    for bulky in ("checkpoints", "initial_hf"):  # GBs on a GPU; the checks after this one need the disk
        shutil.rmtree(run_dir / bulky, ignore_errors=True)
    return out
