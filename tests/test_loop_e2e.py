"""The RL loop end to end through Ray: EP=2 trainer with R3, embedded engine, interrupted and
resumed at another layout (TP=2, where padding leaves TP rank 1 without a real token)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bpo_megatron.observability.metrics import read_metrics
from loop_helpers import Interrupted, assert_the_demo_learned, run_loop

ROOT = Path(__file__).resolve().parents[1]


_run = run_loop  # (result, printed lines); Interrupted after stop_after_step


def _rl_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if "reward_mean" in r]


@pytest.mark.timeout(420)
def test_interrupted_then_resumed_at_another_layout(tmp_path, ray_session, small_run):
    run_dir = tmp_path / "run"
    lines: list[str] = []
    with pytest.raises(Interrupted):  # step 3's metrics are written, its checkpoint is not
        _run(small_run(run_dir, "train.steps=3", "checkpoint.every=2"), stop_after_step=3)
    assert _rl_steps(run_dir) == [1, 2, 3]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000002"
    assert not (run_dir / ".lock").exists(), "the lock is released however the driver stops"

    # resumed with a longer budget on a TP=2 layout (the 128-token vocabulary padded to 256
    # leaves TP rank 1 only padding): the re-run step 3 replaces the interrupted one
    result, lines = _run(small_run(run_dir, "train.steps=4", "checkpoint.every=2", "parallel.tp=2", "parallel.ep=1"))
    assert result["step"] == 4
    assert lines[0] == f"resumed from step 2 ({run_dir / 'checkpoints'})"
    assert not any(line.startswith("sft") for line in lines), "the warm start is not repeated"
    assert _rl_steps(run_dir) == [1, 2, 3, 4]
    assert [r["step"] for r in read_metrics(run_dir) if "sft/nll" in r] == [-1, 0]
    last = [r for r in read_metrics(run_dir) if r["step"] == 4 and "reward_mean" in r][0]
    for key in ("loss", "clip_frac", "grad_norm", "routing_agreement", "abs_logp_diff_mean", "sync_bytes",
                "eval/mean_avg@2", "time/rollout_s"):
        assert key in last, key
    assert last["routing_agreement"] == 1.0  # the trainer routes like the engine on the same weights
    # TP=2 scores what the engine sampled: the gap is the first minibatch's update (lr 3e-4), no more
    assert last["abs_logp_diff_mean"] < 1e-2
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000004"
    # each save says when it starts and what it wrote, so a run stopped during one says so
    saved = run_dir / "checkpoints" / "step-00000004"
    on_disk = sum(p.stat().st_size for p in saved.rglob("*") if p.is_file() and p.name != "checksums.json")
    assert any(line.startswith("saving the checkpoint of step 4 under ") for line in lines), lines
    # written in the background (checkpoint.background's default), the step waiting for its staging
    assert any(line.startswith("the checkpoint of step 4 is being written in the background: training waited ")
               for line in lines), lines
    assert on_disk > 1e6 and any(line.startswith(f"saved the checkpoint of step 4: {on_disk / 1e9:.3f} GB in ")
                                 for line in lines), lines
    assert (run_dir / "curves.png").is_file() and (run_dir / "config.yaml").is_file()
    assert any(line.startswith("[####################] step 4/4 | reward") for line in lines)


@pytest.mark.ci  # two loop runs (CI time): the colocated loop runs in test_loop_over_standin's engine death and
# the kit's CPU rl_loop (test_gpu_smoke), the offload's round trip bit for bit in test_trainer_offload
@pytest.mark.timeout(420)
def test_colocated_phases_offload_the_trainer_and_change_no_number(tmp_path, ray_session, small_run):
    """cluster.colocate: the trainer hands its memory to the engines for every rollout phase
    (parameters, gradient buffers and Adam moments to host memory, storages freed) and takes it
    back to train; the run is metric for metric the run on separate devices."""
    _run(small_run(tmp_path / "apart", "train.steps=2", "cluster.colocate=false"))
    _run(small_run(tmp_path / "shared", "train.steps=2", "cluster.colocate=true"))
    from bpo_megatron.orchestration.phases import MOVE_KEYS

    apart = {r["step"]: r for r in read_metrics(tmp_path / "apart")}
    shared = {r["step"]: r for r in read_metrics(tmp_path / "shared")}
    assert sorted(apart) == sorted(shared) and 2 in apart
    moves = (*MOVE_KEYS, "sync_bytes_per_s")
    for step, record in apart.items():
        for key, value in record.items():
            # clocks; what the device phases moved (syncs, which colocated engines repeat after
            # every release of their memory, offloads, onloads, resumes); and transfer sizes,
            # whose pickling metadata varies by a few bytes
            if "time" in key or key in moves or key.startswith("driver/"):
                continue
            assert shared[step][key] == value, (step, key)
    # every step's record has every key of what moved, apart from the phase times; zero when not run
    for records in (apart, shared):
        assert all(set(moves) <= set(records[step]) and all(records[step][k] >= 0 for k in moves) for step in (1, 2))
    assert all(apart[step][key] == 0 for step in (1, 2) for key in ("offload_bytes", "offload_s", "onload_s"))
    # every rollout phase moved the trainer's parameters, gradients and two Adam moments at least,
    # and every train phase brought them back (each step also evaluates: its sync and offload count)
    params = 4 * 1_000  # the demo model has far more than 1k fp32 parameters
    for step in (1, 2):
        assert apart[step]["push_s"] > 0 and apart[step]["sync_bytes"] > 0
        assert shared[step]["offload_bytes"] > 4 * params
        assert all(shared[step][key] > 0 for key in ("push_s", "offload_s", "onload_s", "resume_s")), shared[step]


@pytest.mark.slow
def test_a_resumed_run_matches_an_uninterrupted_one(tmp_path, ray_session, small_run):
    _run(small_run(tmp_path / "a", "train.steps=2"))
    _run(small_run(tmp_path / "a", "train.steps=3"))
    _run(small_run(tmp_path / "b", "train.steps=3"))
    resumed = [r for r in read_metrics(tmp_path / "a") if r["step"] == 3 and "reward_mean" in r][0]
    straight = [r for r in read_metrics(tmp_path / "b") if r["step"] == 3 and "reward_mean" in r][0]
    for key in ("reward_mean", "loss", "grad_norm", "clip_frac", "eval/mean_avg@2"):
        assert resumed[key] == straight[key], key


@pytest.mark.slow  # CI time (≈ 30 s): run with -m slow
@pytest.mark.timeout(420)
def test_grpo_with_tis_and_r3_and_dapo_batch_shaping(tmp_path, ray_session, small_run):
    """GRPO + TIS + R3 as one config: before its update each step recomputes log π_old under the
    sampling weights (routing replayed); the loss's ratios are taken against it (a step's single
    minibatch starts at π = π_old) and TIS reweights by π_old/μ, which the embedded engine on a
    CPU reproduces to float rounding. With DAPO's dynamic sampling and overlong punishment on,
    every step still trains on prompts_per_step groups."""
    _run(small_run(tmp_path, "train.steps=2", "train.minibatches_per_step=1", "loss.name=grpo",
                   "loss.correction=tis", "train.recompute_old_logprobs=true", "train.dynamic_sampling=true",
                   "train.dynamic_sampling_max_rounds=2", "train.overlong_buffer=2"))
    steps = [r for r in read_metrics(tmp_path) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert 1 <= record["dynamic/rounds"] <= 2 and record["dynamic/drawn_groups"] >= 4
        assert record["zero_std_groups"] <= record["dynamic/filled_groups"]  # only filler lacks variance
        assert record["num_tokens"] == pytest.approx(4 * 4 * record["response_length_mean"])  # 4 groups × 4 responses
        assert -1.0 <= record["overlong/penalty_mean"] <= 0.0
        assert record["abs_logp_diff_mean"] < 1e-5  # π against π_old: the same weights, the same routing
        assert record["clip_frac"] == 0.0
        assert record["mismatch_abs_logp_diff_mean"] < 1e-3  # π_old against the engine's μ
        assert abs(record["correction_weight_mean"] - 1.0) < 1e-3 and record["correction_drop_frac"] == 0.0


# The loop as it was before the asynchronous pipeline, recorded at commit 76ae75b with
#   git worktree add /tmp/sync 76ae75b && cd /tmp/sync && PYTHONPATH=$PWD \
#     bpo-megatron train configs/tiny_moe_cpu.yaml <SYNC_RUN> logging.run_dir=/tmp/sync_run
SYNC_LOOP_METRICS = Path(__file__).parent / "fixtures" / "sync_loop_76ae75b_metrics.jsonl"
SYNC_RUN = ("loss.name=grpo", "train.steps=3", "train.sft_warmup_steps=40", "eval.every=3", "eval.limit=16",
            "checkpoint.every=3")  # GRPO: its warm start was already the one every method now has
# clocks, and the driver's object-store bytes (samples now carry their weight versions: a few bytes)
NOT_REPRODUCIBLE = ("time", "train_time_s", "push_s", "sync_bytes_per_s", "driver/to_trainer_mb")
RENAMED = {"sync_seconds": "push_s"}  # the record's names of what the loop now calls otherwise


@pytest.mark.ci  # a loop run against a stored record (CI time): the rollout pipeline's loop runs in the one-step-off
@pytest.mark.timeout(420)  # run below, its parts in tests/test_rollout_pipeline.py
def test_staleness_zero_reproduces_the_synchronous_loop(tmp_path, ray_session):
    """train.async.max_staleness=0 goes through the rollout pipeline yet writes the metrics file the
    synchronous loop wrote: warm start, rewards, losses, clip and mask fractions, gradient norms,
    routing agreement, weight-sync bytes and evaluation, record for record. The record is from
    76ae75b; since then the embedded engine's one decode loop, the trainer's grouped experts (now
    stacked parameters), its foreach grad norm and torch's fused AdamW (tests/test_fused_adam.py)
    add in another order. One update moves by ~1e-7 relative; over the warm start's and RL's 19
    updates the differences grow to ~2e-4 relative in a grad norm and ~1e-3 in k3 (a difference
    of near-equal log-probabilities), so values agree to 2e-3 relative (1e-6 absolute for the
    near-zero mismatch metrics), while the samples, rewards and evaluations are the same: still
    far below what any change of sample, order or update moves."""
    import json

    from bpo_megatron.experiment import load_experiment

    _run(load_experiment(ROOT / "configs" / "tiny_moe_cpu.yaml",
                         [*SYNC_RUN, "train.async.max_staleness=0", f"logging.run_dir={tmp_path}"]))
    expected = [json.loads(line) for line in SYNC_LOOP_METRICS.read_text().splitlines()]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [r["step"] for r in expected]
    compared = 0
    for old, new in zip(expected, records, strict=True):
        for key, value in old.items():
            key = RENAMED.get(key, key)
            if key in NOT_REPRODUCIBLE or key.startswith("time/"):
                continue
            if key == "offload_bytes":  # fp32 params + 2 Adam moments move; the dead gradients are freed since
                assert new[key] == value * 3 / 4, (old["step"], key)
                continue
            assert new.get(key) == pytest.approx(value, rel=2e-3, abs=1e-6), (old["step"], key, new.get(key), value)
            compared += 1
    assert compared > 150 and any(r.get("reward_mean", 0) > 0 for r in expected)


@pytest.mark.slow  # CI time (≈ 80 s): run with -m slow
@pytest.mark.timeout(420)
def test_every_method_starts_from_the_same_warm_start(tmp_path, ray_session, small_run):
    """The supervised warm start is the log-likelihood gradient whatever loss.name says (BPO's and
    GSPO's gradients at μ = π are not), so the methods of one seed start RL from the same weights:
    the same warm-start losses, and the same first evaluation and first rollouts. (That the run's
    own loss takes over for RL shows in test_grpo_with_tis_and_r3_and_dapo_batch_shaping: its
    correction metrics come only from the run's loss.)"""
    runs = {}
    for loss in ("grpo", "bpo", "gspo"):
        _run(small_run(tmp_path / loss, "train.steps=1", "train.sft_warmup_steps=3", f"loss.name={loss}"))
        runs[loss] = read_metrics(tmp_path / loss)

    def before_rl(records):
        return [(r["step"], r.get("sft/nll"), r.get("eval/mean_avg@2"), r.get("reward_mean"))
                for r in records if r["step"] <= 0 or "reward_mean" in r]
    assert len([r for r in runs["grpo"] if "sft/nll" in r]) == 3
    assert before_rl(runs["bpo"]) == before_rl(runs["grpo"]) == before_rl(runs["gspo"])


@pytest.mark.timeout(420)
def test_one_step_off_policy_trains_on_batches_sampled_one_update_earlier(tmp_path, ray_session, small_run):
    """train.async.max_staleness=1: step s + 1's batch generates while step s trains. Every sample
    records the weights that sampled it: step 1 trains on version 0 (nothing older exists), every
    later step on responses exactly one update old. A checkpoint keeps the data cursor of the first
    prompt no step trained on (the batch under way is generated again on resume)."""
    import json

    _run(small_run(tmp_path, "train.steps=3", "cluster.colocate=false", "train.async.max_staleness=1"))
    steps = {r["step"]: r for r in read_metrics(tmp_path) if "reward_mean" in r}
    assert sorted(steps) == [1, 2, 3]
    assert (steps[1]["async/staleness_max"], steps[2]["async/staleness_max"], steps[3]["async/staleness_max"]) == (
        0.0, 1.0, 1.0)
    assert all(steps[s]["async/staleness_mean"] == steps[s]["async/staleness_max"] for s in steps)
    from bpo_megatron.trainer.checkpoint import STATE_FILE, step_dirs, step_of

    cursors = {step_of(d): json.loads((d / STATE_FILE).read_text())["data_cursor"]
               for d in step_dirs(tmp_path / "checkpoints")}
    sft_prompts = 2 * 8  # train.sft_warmup_steps × train.sft_batch_size
    # at step 2 the batch of step 3 was under way: its 4 prompts are not behind the cursor; the warm
    # start's checkpoint (step 0, kept while its evaluation is the best) is past the warm start's prompts
    assert cursors.pop(0, sft_prompts) == sft_prompts
    assert cursors == {2: sft_prompts + 2 * 4, 3: sft_prompts + 3 * 4}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_demo_learns_one_step_off_policy(tmp_path, ray_session):
    """The CPU demo (120 steps) with train.async.max_staleness=1: the training reward and the
    evaluation accuracy rise (measured: reward 0.32 → 0.41 over the first and last 10 steps, eval
    0.34 → 0.41; synchronously 0.34 → 0.44 and 0.34 → 0.50)."""
    from bpo_megatron.experiment import load_experiment

    cfg = load_experiment("configs/tiny_moe_cpu.yaml", [f"logging.run_dir={tmp_path}", "cluster.colocate=false",
                                                        "train.async.max_staleness=1"])
    _run(cfg)
    assert_the_demo_learned(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("colocate", ["true", "false"])
def test_a_stopped_engine_is_replaced_with_default_settings_and_the_run_goes_on(tmp_path, ray_session, small_run,
                                                                                colocate):
    """SIGSTOP the engine's process during step 2 of a run with default settings (no generate
    timeout; rollout.stall_timeout_s 120 s): whatever call finds it silent — a generation that
    makes no progress or a memory, version or weight call — it is replaced within the stall
    timeout, given the current weights, and the run finishes with every step trained once."""
    import os
    import signal
    import threading
    import time

    import psutil

    from bpo_megatron.loop.rl_loop import run
    from bpo_megatron.rollout.config import RolloutConfig

    stall_s = RolloutConfig().stall_timeout_s
    stopped: list[tuple[int, float]] = []

    def stop_engine() -> None:
        # this process's own Ray only (its raylet's workers are its descendants): never an engine of
        # another run or test worker on the same machine
        for process in psutil.Process().children(recursive=True):
            try:
                cmdline = " ".join(process.cmdline())
            except psutil.Error:
                continue
            if "EngineWorker" in cmdline:
                os.kill(process.pid, signal.SIGSTOP)
                stopped.append((process.pid, time.monotonic()))
                return

    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append((time.monotonic(), line))
        if " step 1/" in line and not stopped:
            threading.Thread(target=stop_engine, daemon=True).start()

    cfg = small_run(tmp_path, "train.steps=4", f"cluster.colocate={colocate}", "eval.every=2")
    result = run(cfg, echo=lambda line: echo(line))
    assert result["step"] == 4 and stopped
    steps = [r["step"] for r in read_metrics(tmp_path) if r["step"] > 0]
    assert steps == [1, 2, 3, 4], "every step trained once"
    pid, at = stopped[0]
    after = [t for t, line in lines if " step 2/" in line]
    assert after and after[0] - at < stall_s + 60, f"step 2 ended {after[0] - at:.0f} s after the stop"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# Packed micro-batches (trainer.max_tokens_per_micro_batch) through the loop. PACKED: at most 20
# positions a micro-batch (the longest sample has 19). RL_SIGNAL: a warm start that makes the
# tiny model answer a few sums right (10 steps of 32 at lr 0.01, about 10 s), and groups of 8, so
# the first RL step already has groups of mixed reward and a nonzero policy loss (measured:
# reward_mean 0.0625, 2 of 4 groups with nonzero advantages, loss -0.037, grad norm 0.63); with
# the small run's own warm start every reward of step 1 is 0, and so are its loss and gradient.
PACKED = "trainer.max_tokens_per_micro_batch=20"
RL_SIGNAL = ("train.sft_warmup_steps=10", "train.sft_batch_size=32", "train.sft_lr=0.01", "rollout.group_size=8")


def _rl_step(run_dir: Path, step: int) -> dict:
    return [r for r in read_metrics(run_dir) if r["step"] == step and "reward_mean" in r][0]


@pytest.mark.slow  # CI time (≈ 60 s; packing's exactness: test_packed_training): run with -m slow
@pytest.mark.timeout(600)
def test_packed_micro_batches_train_the_loop_as_padded_ones_do(tmp_path, ray_session, small_run):
    """trainer.max_tokens_per_micro_batch through Ray: the warm start and the first RL step, packed,
    give the padded run's numbers: the warm start's losses and gradient norms, and the first
    step's log-probs under the trainer (|log π − log μ|, the k3 KL, the importance weights),
    routing agreement, and its policy loss, clip fraction and gradient norm, which are not 0: the
    step's groups differ in reward (RL_SIGNAL)."""
    _run(small_run(tmp_path / "padded", "train.steps=1", "eval.every=0", *RL_SIGNAL))
    _run(small_run(tmp_path / "packed", "train.steps=1", "eval.every=0", *RL_SIGNAL, PACKED))
    padded, packed = read_metrics(tmp_path / "padded"), read_metrics(tmp_path / "packed")
    assert [r["step"] for r in padded] == [r["step"] for r in packed]
    keys = {"sft/nll", "sft/grad_norm", "reward_mean", "zero_std_groups", "abs_logp_diff_mean", "kl_k3", "weight_mean",
            "weight_max", "routing_agreement", "loss", "clip_frac", "grad_norm"}
    compared, worst = set(), {}
    for a, b in zip(padded, packed):
        for key in keys & set(a):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key, b[key], a[key])
            compared.add(key)
            worst[key] = max(worst.get(key, 0.0), abs(b[key] - a[key]) / max(abs(a[key]), 1e-12))
    assert compared == keys
    print("\npacked against padded, largest relative deviation over the warm start and step 1:",
          {k: f"{v:.1e}" for k, v in sorted(worst.items())})
    first = _rl_step(tmp_path / "padded", 1), _rl_step(tmp_path / "packed", 1)
    for record in first:
        assert 0 < record["reward_mean"] < 1 and record["zero_std_groups"] < 4, "groups of mixed reward"
        assert record["loss"] != 0.0 and record["grad_norm"] > 1e-3, "a real policy-gradient step"
    assert first[0]["abs_logp_diff_mean"] > 1e-4  # the trainer's log-probs are not μ's: a real comparison
    assert first[1]["num_micro_batches"] != first[0]["num_micro_batches"], "the packed path ran"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_resumed_packed_run_matches_an_uninterrupted_one(tmp_path, ray_session, small_run):
    """test_a_resumed_run_matches_an_uninterrupted_one with packed micro-batches (and a policy
    loss that is not 0): 2 steps, then resumed to 3 in the same directory, against 3 straight."""
    _run(small_run(tmp_path / "a", "train.steps=2", *RL_SIGNAL, PACKED))
    _, lines = _run(small_run(tmp_path / "a", "train.steps=3", *RL_SIGNAL, PACKED))
    assert lines[0] == f"resumed from step 2 ({tmp_path / 'a' / 'checkpoints'})", lines[0]
    _run(small_run(tmp_path / "b", "train.steps=3", *RL_SIGNAL, PACKED))
    resumed, straight = _rl_step(tmp_path / "a", 3), _rl_step(tmp_path / "b", 3)
    keys = ("reward_mean", "loss", "grad_norm", "clip_frac", "eval/mean_avg@2", "num_micro_batches")
    print("\nresumed against straight, packed, step 3:", {key: (resumed[key], straight[key]) for key in keys})
    for key in keys:
        assert resumed[key] == straight[key], key
    assert straight["loss"] != 0.0 and straight["grad_norm"] > 0


@pytest.mark.slow  # 70 to 100 s here: three fresh runs and two resumed ones
@pytest.mark.timeout(900)
def test_a_packed_checkpoint_resumes_padded_and_back(tmp_path, ray_session, small_run):
    """trainer.max_tokens_per_micro_batch is resume-safe both ways: 2 steps packed then step 3
    padded, and 2 steps padded then step 3 packed, each against 3 padded steps straight. Packing
    changes only the float summation order: the same rollouts at step 3 (identical rewards), and
    its loss and gradient norm to 1e-5."""
    _run(small_run(tmp_path / "padded", "train.steps=3", *RL_SIGNAL))
    for first, then, name in ((PACKED, None, "packed_then_padded"), (None, PACKED, "padded_then_packed")):
        _run(small_run(tmp_path / name, "train.steps=2", *RL_SIGNAL, *filter(None, [first])))
        _, lines = _run(small_run(tmp_path / name, "train.steps=3", *RL_SIGNAL, *filter(None, [then])))
        assert lines[0] == f"resumed from step 2 ({tmp_path / name / 'checkpoints'})", lines[0]
    straight = _rl_step(tmp_path / "padded", 3)
    assert straight["loss"] != 0.0 and straight["grad_norm"] > 0
    for name in ("packed_then_padded", "padded_then_packed"):
        resumed = _rl_step(tmp_path / name, 3)
        print(f"\n{name} against padded, step 3:", {
            key: (resumed[key], straight[key]) for key in ("reward_mean", "response_length_mean", "loss", "grad_norm",
                                                          "clip_frac", "eval/mean_avg@2", "num_micro_batches")})
        for key in ("reward_mean", "response_length_mean", "zero_std_groups", "eval/mean_avg@2"):
            assert resumed[key] == straight[key], (name, key)  # the same rollouts and evaluation
        for key in ("loss", "grad_norm"):
            assert resumed[key] == pytest.approx(straight[key], rel=1e-5), (name, key)
        # differences of log-probs of the weights of two steps' packed or padded updates: absolute
        for key in ("abs_logp_diff_mean", "kl_k3", "weight_mean"):
            assert resumed[key] == pytest.approx(straight[key], rel=0, abs=1e-6), (name, key)
    # the packed path ran where it was asked to: steps 1 and 2 of one run, step 3 of the other
    assert _rl_step(tmp_path / "padded_then_packed", 3)["num_micro_batches"] != straight["num_micro_batches"]
    for step in (1, 2):
        packed, padded = _rl_step(tmp_path / "packed_then_padded", step), _rl_step(tmp_path / "padded", step)
        assert packed["num_micro_batches"] != padded["num_micro_batches"], step
        assert packed["reward_mean"] == padded["reward_mean"], step
        assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-5), step
        twin = _rl_step(tmp_path / "padded_then_packed", step)  # the same padded steps as the straight run's
        assert all(twin[key] == padded[key] for key in ("reward_mean", "loss", "grad_norm", "num_micro_batches")), step


@pytest.mark.slow  # CI time (≈ 50 s): run with -m slow
@pytest.mark.timeout(420)
def test_a_supervised_run_makes_a_base_model_that_rl_runs_start_from(tmp_path, ray_session, small_run):
    """``train.steps=0``: the warm start alone, saved as step 0; exported to Hugging Face format,
    it is the model an RL run with ``model.init=pretrained`` starts from: that run's first
    evaluation (the same questions and seeds) equals the supervised run's, response for response."""
    from bpo_megatron.convert.mcore_to_hf import convert_mcore_to_hf
    from bpo_megatron.trainer.checkpoint import step_dirs, step_of

    base = tmp_path / "base"
    result, lines = _run(small_run(base, "train.steps=0", "train.sft_warmup_steps=4", "eval.limit=16"))
    assert result["step"] == 0 and any(line.startswith("sft 4/4") for line in lines)
    assert [step_of(d) for d in step_dirs(base / "checkpoints")] == [0]
    records = read_metrics(base)
    assert not [r for r in records if "reward_mean" in r]  # no RL step
    hf = convert_mcore_to_hf(str(base / "checkpoints"), str(tmp_path / "hf"), progress=False)
    assert (tmp_path / "hf" / "config.json").exists()
    rl = small_run(tmp_path / "rl", f"model.path={hf}", "model.init=pretrained", "train.sft_warmup_steps=0",
                   "train.steps=1", "eval.limit=16")
    _run(rl)
    first = {k: v for r in read_metrics(tmp_path / "rl") if r["step"] == 0 for k, v in r.items() if k.startswith("eval/")}
    base_eval = {k: v for r in records if r["step"] == 0 for k, v in r.items() if k.startswith("eval/")}
    assert first and first == base_eval


def test_a_run_without_steps_or_warm_start_is_refused(small_run, tmp_path):
    from bpo_megatron.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match=r"train.steps must be >= 1 \(or 0 with "
                       r"train.sft_warmup_steps > 0: a supervised run\), got 0 with train.sft_warmup_steps=0"):
        small_run(tmp_path, "train.steps=0", "train.sft_warmup_steps=0")


# a loop run (CI time): the best-checkpoint rule, its resume and keep_last sparing the best checkpoint
# are tests/test_data_and_eval.py's; a checkpoint saved and resumed in the loop, the interrupted run's above
@pytest.mark.ci
def test_the_best_evaluations_weights_are_kept_step_0_included(tmp_path, ray_session, small_run):
    """Updates too small to change a weight: every evaluation ties the warm start's at step 0, which
    stays the best (the earlier step wins a tie). Its weights exist nowhere but in a checkpoint, so
    the run saves step 0, keeps it past checkpoint.keep_last and names it; a resume from it goes on
    as the uninterrupted run does."""
    run_dir = tmp_path / "run"
    result, lines = _run(small_run(run_dir, "train.steps=2", "optimizer.lr=1.0e-12", "eval.every=1",
                                   "checkpoint.every=0", "checkpoint.keep_last=1"))
    assert result["best_step"] == 0
    assert result["best_weights"] == str(run_dir / "checkpoints" / "step-00000000")
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-00000000", "step-00000002"]
    assert any(line.startswith("saved the checkpoint of step 0:") for line in lines)
    evaluations = [r["eval/mean_avg@2"] for r in read_metrics(run_dir) if "eval/mean_avg@2" in r]
    assert len(evaluations) == 3 and len(set(evaluations)) == 1
