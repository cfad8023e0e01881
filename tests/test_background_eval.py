"""Evaluation beside training (``eval.mode=background``): evaluation engines of their own get each
evaluation step's weights and generate while training goes on; the results land in
``metrics.jsonl`` as records of the steps they evaluated, once, in step order, and the
best-checkpoint rule sees them. With as many evaluation engines as rollout engines they decode the
same batches, so every number equals inline evaluation's.

The fast tests drive the bookkeeping (:class:`~bpo_megatron.eval.scheduler.Evaluations`, the
metrics writer and the tracker mirror) without Ray; the others run the CPU demo through Ray.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from bpo_megatron.observability.metrics import MetricsWriter, evaluation_only, read_metrics
from bpo_megatron.observability.trackers import TRACKERS, Tracker
from loop_helpers import Interrupted, run_loop

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny_moe_cpu.yaml")


_run = run_loop  # (result, printed lines); Interrupted after stop_after_step


def _evaluations(run_dir: Path) -> dict[int, dict]:
    """Step -> its evaluation's metrics (every eval/* metric), from wherever the record holds them."""
    out: dict[int, dict] = {}
    for record in read_metrics(run_dir):
        metrics = {k: v for k, v in record.items() if k.startswith("eval/")}
        if metrics:
            assert record["step"] not in out, f"step {record['step']} evaluated twice"
            out[record["step"]] = metrics
    return out


def _training(run_dir: Path) -> dict[int, dict]:
    """Step -> its training record, without clocks and evaluation."""
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("eval/", "time"))}
            for r in read_metrics(run_dir) if "reward_mean" in r}


class StoreTracker(Tracker):
    """Keeps every point it is sent in ``<run_dir>/store.jsonl``, across attempts (as a tracker's
    server would: nothing is ever deleted)."""

    def __init__(self, run, recorded) -> None:
        self.continued = bool(recorded.get("run_id"))
        self.path = run.run_dir / "store.jsonl"
        self.path.touch()

    def record(self) -> dict:
        return {"run_id": "r0"}

    def log(self, step, metrics, time) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self, *, failed: bool) -> None:
        pass


@pytest.fixture
def store_tracker(monkeypatch):
    monkeypatch.setitem(TRACKERS, "store", f"{__name__}:StoreTracker")


def _points(path: Path) -> Counter:
    """(metric, step) -> how many points the store holds."""
    return Counter((key, json.loads(line)["step"]) for line in path.read_text().splitlines()
                   for key in json.loads(line) if key != "step")


def _expected_points(run_dir: Path) -> Counter:
    return Counter((key, r["step"]) for r in read_metrics(run_dir) for key in r if key not in ("step", "time"))



# ------------------------------------------------------------------------------ bookkeeping
class FakeGeneration:
    """A background evaluation's generation: finished when the test says; its samples carry the
    weight version the engines held."""

    def __init__(self, version: int) -> None:
        from types import SimpleNamespace

        self.finished = False
        self.samples = [SimpleNamespace(weight_version=version)]
        self.on_done = None  # raises as a replacement engine that cannot get the weights would

    def done(self) -> bool:
        if self.on_done is not None:
            self.on_done()
        return self.finished

    def result(self) -> list:
        if self.on_done is not None:
            self.on_done()
        self.finished = True
        return self.samples


class FakeEvaluators:
    """Evaluation engines that hold the version of the last sync."""

    def __init__(self) -> None:
        self.version, self.generations, self.custodian = None, [], None

    def entrust(self, custodian) -> None:
        self.custodian = custodian

    def submit(self, requests) -> FakeGeneration:
        self.generations.append(FakeGeneration(self.version))
        return self.generations[-1]


# each step's correct answers of 8 (one dataset): step 4 ties step 2, the best stays 2
CORRECT = {0: 1, 2: 5, 4: 5, 6: 3}


@pytest.fixture
def evaluations(tmp_path, monkeypatch):
    """:class:`Evaluations` over fake engines, its results read from CORRECT, writing metrics."""
    from types import SimpleNamespace

    from bpo_megatron.eval.avg_at_k import BestCheckpoint, EvalResult
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.eval import scheduler as evaluation

    monkeypatch.setattr(evaluation, "eval_requests", lambda sets, tokenizer, cfg, step: [step])
    monkeypatch.setattr(evaluation, "score_evaluation", lambda samples, sets, tokenizer, reward, cfg, step:
                        EvalResult(step, {"add": (CORRECT[step], 8)}))
    cfg = load_experiment(DEMO, ["eval.mode=background", "eval.k=2", f"logging.run_dir={tmp_path}"])
    engines, trainer = FakeEvaluators(), {"version": 0}
    synced: list[tuple[int, list | None]] = []

    class Sync:  # the evaluation engines' weight sync, recording what it sends
        def __init__(self, trainer, engines, plan) -> None:
            self.engines = engines

        def sync(self, version, only=None):
            synced.append((version, only))
            self.engines.version = version
            return {}

    class Phases:  # the rollout engines' device phases: the trainer's weights version, devices unshared
        version = property(lambda self: trainer["version"])

        def train(self) -> None:
            pass

    monkeypatch.setattr(evaluation, "WeightSync", Sync)

    lines: list[str] = []
    writer = MetricsWriter(tmp_path)
    # the engines as the loop hands them over: still starting, waited for by the first evaluation
    plan = SimpleNamespace(cfg=cfg, eval_sets=[], tokenizer=None, agent=None)
    evals = evaluation.Evaluations(plan, None, BestCheckpoint(), writer, lines.append,
                                   engines=evaluation.in_thread(lambda: engines), trainer=object(), phases=Phases(),
                                   sync_plan=cfg.sync_plan(evaluation=True))
    return SimpleNamespace(evals=evals, engines=engines, trainer=trainer, synced=synced, lines=lines, writer=writer,
                           run_dir=tmp_path)


def test_background_results_land_at_their_steps_once_in_step_order(evaluations):
    """As the loop drives it: evaluation at steps 0, 2, 4, 6 (every 2), a training record per step;
    each evaluation is recorded at the first boundary that finds it finished, as a record of its
    own step, and the best-checkpoint rule sees them in step order (a tie keeps the earlier)."""
    ev, engines, writer = evaluations.evals, evaluations.engines, evaluations.writer
    assert ev.start(0).keys() == {"time/eval_wait_s", "time/eval_sync_s"}
    assert ev.pending_steps() == [0]
    for step in range(1, 7):
        ev.poll()  # the start of a step
        if step == 1:
            assert not (evaluations.run_dir / "metrics.jsonl").exists(), "not finished: nothing recorded"
        if step in (1, 5):  # the evaluations of steps 0 and 4 finish during steps 1 and 5
            engines.generations[-1].finished = True
        evaluations.trainer["version"] = step  # the step trained
        metrics = {"reward_mean": step / 10}
        if step % 2 == 0:
            metrics.update(ev.start(step))  # waits for the evaluation under way, if any
        writer.write(step, metrics)
        ev.poll()
        if step == 3:
            ev.wait(before=3, why="the checkpoint of step 3")  # the evaluation of step 2 finishes first
            assert ev.pending_steps() == []
        if step == 4:
            ev.wait(before=4, why="the checkpoint of step 4")  # the evaluation of step 4 may go on
            assert ev.pending_steps() == [4]
    ev.wait(why="the run ends")
    records = read_metrics(evaluations.run_dir)
    assert [(r["step"], evaluation_only(r)) for r in records] == [
        (1, False), (0, True), (2, False), (3, False), (2, True), (4, False), (5, False), (4, True), (6, False),
        (6, True)]
    assert {r["step"]: r["eval/mean_avg@2"] for r in records if evaluation_only(r)} == {
        step: correct / 8 for step, correct in CORRECT.items()}
    assert evaluations.synced == [(0, None), (2, None), (4, None), (6, None)]
    assert ev.best.step == 2 and ev.best.mean == 5 / 8
    assert [entry[0] for entry in ev.best.history] == [0, 2, 4, 6]
    for step, line in zip(CORRECT, evaluations.lines, strict=True):
        mean = f"{CORRECT[step] / 8:.3f}"
        best = r" \(best\)" if step in (0, 2) else ""
        assert re.fullmatch(rf"eval step {step} \(background, weights version {step}, \d+\.\ds\): add={mean} \| "
                            rf"mean {mean}{best}", line), line


def test_an_evaluation_whose_engine_is_replaced_after_training_moved_on_is_reported_lost(evaluations):
    """A replacement engine gets the evaluated weights while the trainer still holds them; once
    the trainer moved past them the evaluation cannot finish: an echo line names it, nothing is
    recorded, and the next evaluation goes on."""
    from bpo_megatron.eval.scheduler import StaleEvaluation

    ev, engines = evaluations.evals, evaluations.engines
    ev.start(0)
    generation = engines.generations[0]
    generation.on_done = lambda: engines.custodian.resync([1])
    ev.poll()
    assert ev.pending_steps() == [0] and evaluations.synced[-1] == (0, [1]), "same version: the replacement is synced"
    evaluations.trainer["version"] = 1  # step 1 trained
    with pytest.raises(StaleEvaluation, match=r"engines \[1\] were replaced while evaluating the weights of step 0"):
        engines.custodian.resync([1])
    ev.poll()
    assert ev.pending_steps() == [] and not (evaluations.run_dir / "metrics.jsonl").exists()
    assert evaluations.lines == ["eval step 0 (background) lost: evaluation engines [1] were replaced while "
                                 "evaluating the weights of step 0, and the trainer holds those of step 1 now; the "
                                 "run goes on and the next evaluation uses the replaced engines"]
    evaluations.trainer["version"] = 2
    ev.start(2)
    ev.wait()
    assert [r["step"] for r in read_metrics(evaluations.run_dir)] == [2] and ev.best.step == 2


def test_samples_of_other_weights_are_refused(evaluations):
    ev, engines = evaluations.evals, evaluations.engines
    with pytest.raises(RuntimeError, match="evaluation of step 2 was asked for while the trainer holds the weights of "
                                           "step 0"):
        ev.start(2)
    evaluations.trainer["version"] = 2
    ev.start(2)
    engines.generations[0].samples[0].weight_version = 1
    with pytest.raises(RuntimeError, match=r"evaluation of step 2 was generated with weight versions \[1\], not 2"):
        ev.wait()


def test_background_evaluation_records_count_no_training_step_in_runs_csv():
    """compare's rows: an evaluation recorded apart from its step's record gives the rows inline
    evaluation gives (the same trained steps and training means since the previous evaluation)."""
    from bpo_megatron.commands.runs_csv import run_rows

    evals = {s: {"eval/add_avg@2": s / 8, "eval/mean_avg@2": s / 8} for s in (0, 2, 4)}
    train = {s: {"reward_mean": s / 10, "time/step_s": 1.0 + s} for s in range(1, 5)}
    inline = [{"step": 0, **evals[0]}] + [{"step": s, **train[s], **evals.get(s, {})} for s in range(1, 5)]
    background = [{"step": 1, **train[1]}, {"step": 0, **evals[0]}, {"step": 2, **train[2]}, {"step": 3, **train[3]},
                  {"step": 2, **evals[2]}, {"step": 4, **train[4]}, {"step": 4, **evals[4]}]
    assert not evaluation_only(inline[2]) and evaluation_only(background[1])
    kwargs = dict(run="r", method="BPO", method_id="bpo", staleness=None, seed=1, recompute_old_logprobs=False)
    rows = run_rows(background, **kwargs)
    assert rows == run_rows(inline, **kwargs)
    assert [(r.step, r.accuracy, r.trained_steps) for r in rows] == [(0, 0.0, 0), (2, 0.25, 2), (4, 0.5, 2)]
    assert rows[2].training == {"reward_mean": 0.35, "time/step_s": 4.5}


def test_evaluation_engines_get_bundles_of_their_own_colocated_or_not():
    from bpo_megatron.orchestration.config import ClusterConfig
    from bpo_megatron.orchestration.placement import plan_layout

    recipe = dict(trainer_ranks=32, gpus_per_trainer_rank=1, gpus_per_engine=4, nodes=5, gpus_per_node=8)
    shared = plan_layout(ClusterConfig(**recipe, colocate=True), num_engines=8, eval_engines=2)
    assert len(shared.bundles) == 40 and shared.gpus == 40
    assert shared.engine_bundles[-1] == (28, 29, 30, 31)  # the rollout engines on the trainer's GPUs
    assert shared.eval_engine_bundles == ((32, 33, 34, 35), (36, 37, 38, 39))
    assert [(s.bundle, s.num_gpus, s.num_cpus) for s in shared.eval_engines] == [(32, 1.0, 1.0), (36, 1.0, 1.0)]
    apart = plan_layout(ClusterConfig(**{**recipe, "trainer_ranks": 24}, colocate=False), num_engines=2,
                        eval_engines=1)
    assert len(apart.bundles) == 36 and apart.engine_bundles == ((24, 25, 26, 27), (28, 29, 30, 31))
    assert apart.eval_engine_bundles == ((32, 33, 34, 35),)
    cpu = plan_layout(ClusterConfig(trainer_ranks=2, colocate=True), num_engines=1, eval_engines=1)
    assert len(cpu.bundles) == 3 and cpu.eval_engine_bundles == ((2,),) and cpu.gpus == 0
    assert [(s.bundle, s.num_gpus, s.num_cpus) for s in cpu.eval_engines] == [(2, 0.0, 1.0)]


@pytest.mark.parametrize("overrides, message", [
    (["eval.mode=sideways"], "eval.mode='sideways' is unknown; choose one of ['inline', 'background']"),
    (["eval.engines=2"], "eval.engines=2 counts background evaluation engines, but eval.mode=inline evaluates on the "
                         "rollout engines: set eval.mode=background (or eval.engines=null)"),
    (["eval.mode=background", "eval.every=0"], "eval.mode=background starts evaluation engines, but eval.every=0 never "
                                               "evaluates: set eval.every > 0 (or eval.mode=inline)"),
    (["eval.mode=background", "eval.engines=0"], "eval.engines=0 must be >= 1 (or null: rollout.num_engines)"),
])
def test_impossible_evaluation_settings_exit_2_naming_the_field_before_anything_starts(
        overrides, message, tmp_path, capsys, monkeypatch):
    from bpo_megatron.cli import main
    from bpo_megatron.loop import preflight, rl_loop

    def started(*args, **kwargs):  # the run's preparation (run directory, Ray) must never be reached
        raise AssertionError("the run started")

    monkeypatch.setattr(preflight, "prepare", started)
    monkeypatch.setattr(rl_loop, "execute", started)
    assert main(["train", DEMO, *overrides, f"logging.run_dir={tmp_path}/r"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_background_evaluation_is_a_resume_safe_setting():
    from bpo_megatron.loop.run_dir import config_changes

    assert config_changes({"eval": {"mode": "inline", "engines": None}},
                          {"eval": {"mode": "background", "engines": 2}}) == {}


def _attempts_with_an_evaluation_past_the_checkpoint(run_dir: Path, trackers: tuple[str, ...]) -> None:
    """Attempt 1 saves the checkpoint of step 2 while step 2's evaluation runs (3 records then),
    records that evaluation after step 3 and is killed after step 4; attempts 2 and 3 resume from
    step 2 and record it before step 3's record (attempt 2 is killed after step 3)."""
    train = {s: {"reward_mean": s / 10, "time/step_s": 0.5} for s in range(1, 5)}
    evals = {s: {"eval/mean_avg@2": s / 8, "eval/add_correct_even": float(s)} for s in range(0, 5, 2)}
    attempts = [(None, [(0, evals[0]), (1, train[1]), (2, train[2]), (3, train[3]), (2, evals[2]), (4, train[4])]),
                (3, [(2, evals[2]), (3, train[3])]),
                (3, [(3, train[3]), (2, evals[2]), (4, train[4]), (4, evals[4])])]
    for number, (keep, records) in enumerate(attempts):
        writer = MetricsWriter(run_dir, trackers=trackers, config={"name": "demo"},
                               resume_after=None if keep is None else 2, keep_records=keep)
        for step, metrics in records:
            writer.write(step, metrics)
        writer.close(failed=number < 2)


def test_a_resume_drops_an_evaluation_recorded_after_its_checkpoint_and_mirrors_each_record_once(
        tmp_path, store_tracker):
    """A tracker that keeps its points holds every record once, though the attempts wrote them
    in other orders; trackers.json lists what it holds past metrics.jsonl's order meanwhile."""
    _attempts_with_an_evaluation_past_the_checkpoint(tmp_path, ("store",))
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 2, 4, 4]
    assert _points(tmp_path / "store.jsonl") == _expected_points(tmp_path)
    assert json.loads((tmp_path / "trackers.json").read_text())["store"] == {"run_id": "r0", "records": 7}


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_each_real_tracker_holds_an_evaluation_landing_after_later_steps_once(tmp_path, name, monkeypatch):
    """The same attempts with TensorBoard (which hides the steps after the checkpoint itself, but
    not step 2's evaluation logged after them), Weights & Biases (offline) and MLflow (file
    store), each read back with its own package."""
    import warnings

    pytest.importorskip(name)
    from test_trackers import READERS

    from bpo_megatron.observability.trackers import TrackerWarning

    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrackerWarning)  # a failing tracker would otherwise only warn
        _attempts_with_an_evaluation_past_the_checkpoint(tmp_path, (name,))
    expected = {}
    for (key, step), count in _expected_points(tmp_path).items():
        expected.setdefault(key, Counter())[step] += count
    assert READERS[name](tmp_path) == expected


# ------------------------------------------------------------------------------ through Ray

# A warm start after which the tiny model answers some sums (about 10 s; see test_loop_e2e.RL_SIGNAL),
# 16 questions × 2 responses per evaluation, an evaluation every step and a checkpoint at step 2
SCHEDULE = ("train.sft_warmup_steps=10", "train.sft_batch_size=32", "train.sft_lr=0.01", "eval.every=1",
            "eval.limit=16", "eval.k=2", "checkpoint.every=2")
# clocks (train_time_s too), evaluation, the rollout engines' syncs and the colocated trainer's
# offloads (inline evaluation at the last step syncs the rollout engines once more) and the
# driver's object-store bytes (pickling metadata varies by a few bytes)
NOT_COMPARED = ("time", "eval/", "sync_", "offload_", "driver/")  # and every wall-clock second (a name ending _s)


@pytest.mark.timeout(600)
def test_background_evaluation_gives_inline_numbers_each_once(tmp_path, ray_session, small_run):
    """The same run with eval.mode inline and background: every evaluation (steps 0-3: counts,
    halves, Avg@k) is the same, recorded once, in background mode as a record of its own step in
    step order; the training records and the best checkpoint are the same too."""
    results = {}
    for mode in ("inline", "background"):
        results[mode], _ = _run(small_run(tmp_path / mode, "train.steps=3", *SCHEDULE, f"eval.mode={mode}"))
    inline, background = _evaluations(tmp_path / "inline"), _evaluations(tmp_path / "background")
    assert sorted(inline) == [0, 1, 2, 3]
    assert background == inline
    assert any(metrics["eval/mean_avg@2"] > 0 for metrics in inline.values()), "the warm start answers some"
    assert {m["eval/procedural:add_responses_even"] + m["eval/procedural:add_responses_odd"]
            for m in inline.values()} == {32.0}
    records = read_metrics(tmp_path / "background")
    apart = [r for r in records if evaluation_only(r)]
    assert [r["step"] for r in apart] == [0, 1, 2, 3], "each evaluation once, in step order"
    assert not any(k.startswith("eval/") for r in records if not evaluation_only(r) for k in r)
    assert all(r["time/eval_sync_s"] >= 0 and r["time/eval_wait_s"] >= 0 for r in records if "reward_mean" in r)
    strip = lambda run: {step: {k: v for k, v in r.items() if not k.startswith(NOT_COMPARED) and not k.endswith("_s")}  # noqa: E731
                         for step, r in _training(tmp_path / run).items()}
    assert strip("background") == strip("inline") and sorted(strip("inline")) == [1, 2, 3]
    assert (results["background"]["best_step"], results["background"]["best_mean"]) == (
        results["inline"]["best_step"], results["inline"]["best_mean"])


@pytest.mark.slow  # about 4 minutes here: three runs
@pytest.mark.timeout(900)
def test_a_run_killed_with_an_evaluation_under_way_resumes_it_once(tmp_path, ray_session, small_run, monkeypatch,
                                                                   store_tracker):
    """No evaluation is seen finished between steps (``done`` stays False), so each one lands when
    the next evaluation, a checkpoint or the end waits for it: the checkpoint of step 2 is saved
    while step 2's evaluation runs, which is recorded during step 3, and the driver is killed
    right after step 3's record. The resumed run evaluates step 2 again from the checkpoint's
    weights: every evaluation equals the inline run's, none is recorded twice, and a tracker
    that keeps its points holds every record once."""
    from bpo_megatron.orchestration.engine_group import PendingGeneration
    from bpo_megatron.trainer.checkpoint import STATE_FILE

    _run(small_run(tmp_path / "inline", "train.steps=4", *SCHEDULE))
    monkeypatch.setattr(PendingGeneration, "done", lambda self: False)
    background = (*SCHEDULE, "eval.mode=background", "logging.trackers=[store]")
    run_dir = tmp_path / "background"
    with pytest.raises(Interrupted):
        _run(small_run(run_dir, "train.steps=4", *background), stop_after_step=3)
    state = json.loads((run_dir / "checkpoints" / "step-00000002" / STATE_FILE).read_text())
    assert state["eval_pending"] == [2] and [entry[0] for entry in state["eval_history"]] == [0, 1]
    # step 2 waited for step 1's evaluation before its weights went to the evaluation engine
    assert [r["step"] for r in read_metrics(run_dir)][:state["metrics_records"]][-3:] == [1, 1, 2]
    assert 2 in _evaluations(run_dir), "the killed attempt recorded step 2's evaluation after the checkpoint"

    result, lines = _run(small_run(run_dir, "train.steps=4", *background))
    assert lines[0] == f"resumed from step 2 ({run_dir / 'checkpoints'})"
    assert [line.split(" (")[0] for line in lines if line.startswith("eval step")] == [
        "eval step 2", "eval step 3", "eval step 4"]
    assert _evaluations(run_dir) == _evaluations(tmp_path / "inline")
    assert [r["step"] for r in read_metrics(run_dir) if evaluation_only(r)] == [0, 1, 2, 3, 4]
    assert _points(run_dir / "store.jsonl") == _expected_points(run_dir)
    inline_state = json.loads((tmp_path / "inline" / "checkpoints" / "step-00000004" / STATE_FILE).read_text())
    assert result["best_step"] == inline_state["best_step"]
    assert json.loads((run_dir / "checkpoints" / "step-00000004" / STATE_FILE).read_text())["eval_pending"] == []
