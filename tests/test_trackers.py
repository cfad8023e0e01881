"""Experiment trackers (``logging.trackers``): each mirrors every record of ``metrics.jsonl`` once,
continues its own run across a kill and a resume, and never stops the run when it fails.

The fast tests drive :class:`MetricsWriter` as the loop does (attempts that resume from a
checkpointed step) with trackers of this file and with the real TensorBoard, Weights & Biases
(offline) and MLflow (file store), each read back with the package's own reader; the packages
that are not installed are skipped (``pip install -e .[trackers]``). The last test runs the CPU
demo through Ray with all three, then resumes it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest

from bpo_megatron.config import ConfigError
from bpo_megatron.observability.config import LoggingConfig
from bpo_megatron.observability.metrics import MetricsWriter, read_metrics
from bpo_megatron.observability.trackers import TRACKERS, Tracker, TrackerWarning
from bpo_megatron.observability.trackers.mirror import LEDGER_FILE

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny_moe_cpu.yaml")
CONFIG = {"name": "demo", "train": {"steps": 4, "async": {"max_staleness": 0}}, "logging": {"run_dir": "runs/{name}"}}

# The records of a run as the loop writes them: two warm-start steps (the last at step 0), the
# evaluation at step 0, then one record per RL step; names as the loop spells them.
RECORDS = [(-1, {"sft/nll": 2.0}), (0, {"sft/nll": 1.0}), (0, {"eval/mean_avg@2": 0.25})] + [
    (step, {"reward_mean": step / 10, "loss": 1.0 / step, "time/step_s": 0.5, "eval/mean_avg@2": step / 8})
    for step in range(1, 5)]


def _attempt(run_dir: Path, trackers, *, steps: range | None, resume_after: int | None = None,
             settings: LoggingConfig | None = None, config: dict | None = None, killed: bool = False) -> MetricsWriter:
    """One driver attempt: the records of ``steps`` (None: the warm start and steps 1-2 too), closed
    as the loop closes it (``killed``: as a driver that stopped on an error)."""
    writer = MetricsWriter(run_dir, trackers=trackers, config=config or CONFIG, settings=settings or LoggingConfig(),
                           resume_after=resume_after)
    for step, metrics in RECORDS:
        if (steps is None and step <= 2) or (steps is not None and step in steps):
            writer.write(step, metrics)
    writer.close(failed=killed)
    return writer


def _kill_after_3_then_resume_from_2(run_dir: Path, trackers, **kwargs) -> None:
    """Steps up to 3 written, the checkpoint of step 2 the newest: killed; resumed to step 4."""
    _attempt(run_dir, trackers, steps=None, **kwargs)
    _attempt(run_dir, trackers, steps=range(3, 4), resume_after=2, killed=True, **kwargs)
    _attempt(run_dir, trackers, steps=range(3, 5), resume_after=2, **kwargs)


def _expected(run_dir: Path) -> dict[str, Counter]:
    """Metric name -> the steps metrics.jsonl holds it at, counted."""
    expected: dict[str, Counter] = {}
    for record in read_metrics(run_dir):
        for key in record.keys() - {"step", "time"}:
            expected.setdefault(key, Counter())[record["step"]] += 1
    return expected


# ------------------------------------------------------------------------------ trackers of this file
class StoreTracker(Tracker):
    """Keeps its points in ``<run_dir>/store-<run id>.jsonl``, as a tracker's server would: a
    resumed attempt appends to the run it recorded, nothing is ever deleted."""

    def __init__(self, run, recorded) -> None:
        self.continued = bool(recorded.get("run_id"))
        self.run_id = recorded["run_id"] if self.continued else f"r{len(list(run.run_dir.glob('store-*')))}"
        self.path = run.run_dir / f"store-{self.run_id}.jsonl"
        self.path.touch()

    def record(self) -> dict:
        return {"run_id": self.run_id}

    def log(self, step, metrics, time) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self, *, failed: bool) -> None:
        pass

    @staticmethod
    def points(run_dir: Path) -> dict[str, Counter]:
        (path,) = run_dir.glob("store-*.jsonl")  # one run, whatever the attempts
        points: dict[str, Counter] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            for key in record.keys() - {"step"}:
                points.setdefault(key, Counter())[record["step"]] += 1
        return points


class UnstartableTracker(Tracker):
    def __init__(self, run, recorded) -> None:
        raise ConnectionError("no server at tracker.invalid")


class FailsAtStep3(StoreTracker):
    def log(self, step, metrics, time) -> None:
        if step == 3:
            raise OSError("disk quota exceeded")
        super().log(step, metrics, time)


@pytest.fixture
def fake_trackers(monkeypatch):
    for name, cls in (("store", StoreTracker), ("unstartable", UnstartableTracker), ("fails_at_3", FailsAtStep3)):
        monkeypatch.setitem(TRACKERS, name, f"{__name__}:{cls.__name__}")


def test_a_resumed_run_mirrors_every_record_once_in_the_same_tracker_run(tmp_path, fake_trackers):
    _kill_after_3_then_resume_from_2(tmp_path, ("store",))
    assert [r["step"] for r in read_metrics(tmp_path)] == [-1, 0, 0, 1, 2, 3, 4]
    assert StoreTracker.points(tmp_path) == _expected(tmp_path)
    ledger = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert ledger == {"store": {"run_id": "r0", "records": 7}}


def test_a_tracker_added_on_resume_gets_the_records_so_far(tmp_path, fake_trackers):
    _attempt(tmp_path, (), steps=None)
    _attempt(tmp_path, ("store",), steps=range(3, 5), resume_after=2)
    assert StoreTracker.points(tmp_path) == _expected(tmp_path)


def test_a_fresh_restart_continues_the_tracker_run_without_repeating(tmp_path, fake_trackers):
    """Killed before the first checkpoint: the next attempt starts afresh (metrics.jsonl emptied)
    and writes the same records again; the tracker run holds each once."""
    _attempt(tmp_path, ("store",), steps=range(-1, 1), killed=True)
    _attempt(tmp_path, ("store",), steps=None)
    assert StoreTracker.points(tmp_path) == _expected(tmp_path)


def test_a_tracker_that_cannot_start_is_a_warning_and_the_others_go_on(tmp_path, fake_trackers):
    with pytest.warns(TrackerWarning, match=r"tracker unstartable could not start \(ConnectionError: no server"):
        writer = _attempt(tmp_path, ("unstartable", "store"), steps=None)
    assert writer.trackers == ()  # closed
    assert StoreTracker.points(tmp_path) == _expected(tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path)] == [-1, 0, 0, 1, 2]


def test_a_tracker_that_fails_while_logging_warns_once_and_catches_up_on_resume(tmp_path, fake_trackers, monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = MetricsWriter(tmp_path, trackers=("fails_at_3", "store"), config=CONFIG)
        for step, metrics in RECORDS:
            writer.write(step, metrics)
        assert writer.trackers == ("store",)
        writer.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert messages == ["tracker fails_at_3 failed to log step 3 (OSError: disk quota exceeded); "
                        "the run goes on without it"]
    assert [r["step"] for r in read_metrics(tmp_path)] == [-1, 0, 0, 1, 2, 3, 4]
    ledger = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert ledger["fails_at_3"]["records"] == 5 and ledger["store"]["records"] == 7
    # resumed from step 4 with a tracker that works again: its run gets steps 3 and 4 at start
    monkeypatch.setitem(TRACKERS, "fails_at_3", f"{__name__}:StoreTracker")
    MetricsWriter(tmp_path, trackers=("fails_at_3",), config=CONFIG, resume_after=4).close()
    ledger = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert ledger["fails_at_3"]["records"] == 7
    for path in tmp_path.glob("store-*.jsonl"):
        steps = Counter(json.loads(line)["step"] for line in path.read_text().splitlines())
        assert steps == Counter({-1: 1, 0: 2, 1: 1, 2: 1, 3: 1, 4: 1}), path.name


# ------------------------------------------------------------------------------ config
def test_unknown_or_contradictory_trackers_are_refused_before_anything_starts(tmp_path, capsys, monkeypatch):
    from bpo_megatron.cli import main
    from bpo_megatron.loop import preflight, rl_loop

    def started(*args, **kwargs):  # the run's preparation (run directory, Ray) must never be reached
        raise AssertionError("the run started")

    monkeypatch.setattr(preflight, "prepare", started)
    monkeypatch.setattr(rl_loop, "execute", started)

    assert main(["train", DEMO, "logging.trackers=[tensorboard,neptune]", f"logging.run_dir={tmp_path}/r"]) == 2
    err = capsys.readouterr().err
    assert "logging.trackers: no tracker 'neptune'; there are mlflow, tensorboard, wandb" in err
    assert main(["train", DEMO, "logging.trackers=[tensorboard]", "logging.tensorboard=false"]) == 2
    assert "logging.tensorboard=false contradicts logging.trackers" in capsys.readouterr().err
    assert main(["train", DEMO, "logging.trackers=[wandb,wandb]"]) == 2
    assert "logging.trackers lists wandb twice" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_tensorboard_alone_by_default_and_the_old_switch_still_turns_it_off():
    from bpo_megatron.experiment import load_experiment

    assert load_experiment(DEMO, []).logging.tracker_names == ("tensorboard",)
    assert load_experiment(DEMO, ["logging.tensorboard=false"]).logging.tracker_names == ()
    assert load_experiment(DEMO, ["logging.trackers=[mlflow,wandb]"]).logging.tracker_names == ("mlflow", "wandb")
    assert load_experiment(DEMO, ["logging.trackers=[]"]).logging.tracker_names == ()
    with pytest.raises(ConfigError, match="logging.trackers"):
        load_experiment(DEMO, ["logging.trackers=wandb"])


# ------------------------------------------------------------------------------ the real trackers
def mlflow_points(run_dir: Path, uri: str | None = None) -> dict[str, Counter]:
    """Metric name (as metrics.jsonl spells it) -> steps, from the MLflow run the ledger records."""
    from bpo_megatron.observability.trackers.mlflow import client, default_uri, mlflow_metric_name

    entry = json.loads((run_dir / LEDGER_FILE).read_text())["mlflow"]
    store = client(uri or default_uri(run_dir))
    assert entry["uri"] == (uri or default_uri(run_dir))
    assert len(store.search_runs([e.experiment_id for e in store.search_experiments()])) == 1, "one run"
    run = store.get_run(entry["run_id"])
    names = {mlflow_metric_name(key): key for key in _expected(run_dir)}
    assert set(run.data.metrics) == set(names)
    return {names[key]: Counter(m.step for m in store.get_metric_history(entry["run_id"], key))
            for key in run.data.metrics}


def wandb_records(path: Path) -> list[dict]:
    """The records of an offline run's ``.wandb`` file, read with wandb's own reader."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def wandb_rows(run_dir: Path) -> list[dict]:
    """Every history row of the run's offline wandb directories (one per attempt)."""
    run_id = json.loads((run_dir / LEDGER_FILE).read_text())["wandb"]["run_id"]
    rows = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        assert path.name == f"run-{run_id}.wandb", "every attempt logs to the recorded run"
        rows += [r["history"]["item"] for r in wandb_records(path) if r.get("type") == "history"]
    return rows


def wandb_points(run_dir: Path) -> dict[str, Counter]:
    points: dict[str, Counter] = {}
    for row in wandb_rows(run_dir):
        for key in row.keys() - {"step", "_step", "_runtime", "_timestamp"}:
            points.setdefault(key, Counter())[row["step"]] += 1
    return points


def tensorboard_points(run_dir: Path) -> dict[str, Counter]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {key: Counter(e.step for e in events.Scalars(key)) for key in events.Tags()["scalars"]}


READERS = {"tensorboard": tensorboard_points, "wandb": wandb_points, "mlflow": mlflow_points}  # each its package's


@pytest.mark.parametrize("name", sorted(READERS))
def test_each_tracker_holds_every_record_once_across_a_kill_after_the_checkpoint(tmp_path, name, monkeypatch):
    pytest.importorskip(name)
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrackerWarning)  # a failing tracker would otherwise only warn
        _kill_after_3_then_resume_from_2(tmp_path, (name,))
    assert READERS[name](tmp_path) == _expected(tmp_path)


def test_mlflow_records_the_identity_and_config_and_the_changes_of_a_resume(tmp_path):
    pytest.importorskip("mlflow")
    from bpo_megatron.observability.trackers import source_commit
    from bpo_megatron.observability.trackers.mlflow import client, default_uri

    _attempt(tmp_path, ("mlflow",), steps=None)
    longer = {**CONFIG, "train": {**CONFIG["train"], "steps": 6}}
    _attempt(tmp_path, ("mlflow",), steps=range(3, 5), resume_after=2, config=longer)
    entry = json.loads((tmp_path / LEDGER_FILE).read_text())["mlflow"]
    run = client(default_uri(tmp_path)).get_run(entry["run_id"])
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
    assert run.data.tags["bpo.run_dir"] == str(tmp_path.resolve())
    assert run.data.tags.get("mlflow.source.git.commit") == source_commit()
    assert run.data.params["train.steps"] == "4" and run.data.params["train.async.max_staleness"] == "0"
    assert run.data.tags["resumed_at_step_2.train.steps"] == "6"


def test_an_mlflow_store_that_cannot_be_written_is_a_warning(tmp_path):
    pytest.importorskip("mlflow")
    settings = LoggingConfig(mlflow_uri="file:///proc/no-such-store")  # /proc refuses new directories, even root's
    with pytest.warns(TrackerWarning, match="tracker mlflow could not start"):
        writer = _attempt(tmp_path, ("mlflow",), steps=None, settings=settings)
    assert writer.trackers == ()
    assert [r["step"] for r in read_metrics(tmp_path)] == [-1, 0, 0, 1, 2]


def test_wandb_is_offline_and_names_the_run_after_its_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from bpo_megatron.observability.trackers import source_commit

    monkeypatch.delenv("WANDB_MODE", raising=False)
    _attempt(tmp_path, ("wandb",), steps=None)
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    (run,) = [r["run"] for r in wandb_records(path) if r.get("type") == "run"]
    assert run["display_name"] == tmp_path.name and run["notes"] == f"run directory: {tmp_path.resolve()}"
    assert run["config"]["update"]["train"] == CONFIG["train"]
    assert run.get("git", {}).get("commit") == source_commit()


@pytest.mark.slow  # CI time (≈ 60 s; each tracker across a kill stays): run with -m slow
# ------------------------------------------------------------------------------ the loop
@pytest.mark.timeout(420)
def test_the_demo_mirrors_its_metrics_to_every_tracker_across_a_resume(tmp_path, ray_session, small_run, fake_trackers,
                                                                        monkeypatch):
    for package in READERS:
        pytest.importorskip(package)
    from bpo_megatron.loop.rl_loop import run

    monkeypatch.delenv("WANDB_MODE", raising=False)
    everything = "logging.trackers=[tensorboard,wandb,mlflow,unstartable]"
    # SMALL_RUN turns TensorBoard off with the switch from before logging.trackers: on again
    with pytest.warns(TrackerWarning, match="tracker unstartable could not start"):
        run(small_run(tmp_path, "train.steps=2", everything, "logging.tensorboard=true"), echo=lambda line: None)
    lines: list[str] = []
    run(small_run(tmp_path, "train.steps=3", "logging.trackers=[tensorboard,wandb,mlflow]", "logging.tensorboard=true"),
        echo=lines.append)
    assert lines[0].startswith("resumed from step 2")
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2, 3]
    expected = _expected(tmp_path)
    assert "eval/mean_avg@2" in expected and "time/rollout_s" in expected
    for name, points in READERS.items():
        assert points(tmp_path) == expected, name


def test_a_requested_tracker_whose_package_is_missing_is_refused_by_check_and_before_the_run(tmp_path, capsys,
                                                                                            monkeypatch):
    import importlib.util

    from bpo_megatron.cli import main
    from bpo_megatron.loop import rl_loop

    def started(*args, **kwargs):  # Ray and the model must never be reached
        raise AssertionError("the run started")

    monkeypatch.setattr(rl_loop, "execute", started)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    why = ("logging.trackers lists wandb, but its package 'wandb' is not installed: pip install wandb, or drop wandb "
           "from logging.trackers")
    for extra in (["--check"], []):
        code = main(["train", DEMO, "logging.trackers=[tensorboard,wandb]", f"logging.run_dir={tmp_path}/r", *extra])
        assert code == 2
        assert f"bpo-megatron train: {why}" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    # the implicit TensorBoard of logging.trackers: null is not refused (a tracker that cannot
    # start is a warning: test_a_tracker_that_cannot_start_is_a_warning_and_the_others_go_on)
    assert main(["train", DEMO, f"logging.run_dir={tmp_path}/r", "--check"]) == 0


def test_a_tracker_package_that_is_only_a_directory_or_does_not_import_is_refused_and_implicit_tensorboard_noted(
        tmp_path, capsys, monkeypatch):
    """A lookup alone passed a tracker whose package is only a directory of its name on the import
    path (a leftover ``wandb/`` in the working directory, what an uninstall left behind) or whose
    import fails: --check said nothing and the run only warned at its start. Both are refused now,
    naming the reason; TensorBoard, started implicitly (``logging.trackers: null``), is not refused
    but --check says when it cannot start."""
    from bpo_megatron.cli import main
    from bpo_megatron.loop import rl_loop
    from bpo_megatron.observability.trackers.tensorboard import TensorBoardTracker
    from bpo_megatron.observability.trackers.wandb import WandbTracker

    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(rl_loop, "execute", started)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "w47_wandb_leftover").mkdir()  # a directory, no package
    broken = tmp_path / "w47_wandb_broken"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('libwandb_core.so: cannot open shared object file')\n")
    run_dir = tmp_path / "r"
    expected = {
        "w47_wandb_leftover": (f"logging.trackers lists wandb, but its package 'w47_wandb_leftover' is not installed "
                               f"(what the import finds is only a directory of that name: {tmp_path / 'w47_wandb_leftover'}): "
                               "pip install w47_wandb_leftover, or drop wandb from logging.trackers"),
        "w47_wandb_broken": ("logging.trackers lists wandb, but its package 'w47_wandb_broken' does not import (ImportError: "
                             "libwandb_core.so: cannot open shared object file): pip install w47_wandb_broken, or drop wandb "
                             "from logging.trackers"),
    }
    for package, why in expected.items():
        monkeypatch.setattr(WandbTracker, "package", package)
        code = main(["train", DEMO, "logging.trackers=[wandb]", f"logging.run_dir={run_dir}", "--check"])
        assert code == 2
        assert f"bpo-megatron train: {why}" in capsys.readouterr().err
    monkeypatch.setattr(TensorBoardTracker, "package", "w47_wandb_leftover")
    assert main(["train", DEMO, f"logging.run_dir={run_dir}", "--check"]) == 0
    out = capsys.readouterr().out
    assert ("note: logging.trackers is null, so the run mirrors its metrics to TensorBoard, whose package "
            "'w47_wandb_leftover' is not installed (what the import finds is only a directory") in out
    assert "the run writes metrics.jsonl alone (pip install w47_wandb_leftover; or set logging.tensorboard=false" in out
    assert main(["train", DEMO, f"logging.run_dir={run_dir}", "logging.tensorboard=false", "--check"]) == 0
    assert "TensorBoard" not in capsys.readouterr().out
    assert not run_dir.exists()
