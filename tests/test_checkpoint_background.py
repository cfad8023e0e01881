"""Checkpoints written in the background (``TrainActor.save(background=True)``).

The writer is held (``checkpoint.TEST_HOLD_WRITER_ENV``) once it has written its files, so the
training steps after the save run while it is in flight and a kill lands while it is: a resume
from a background save continues exactly as one from a blocking save of the same state, and a
kill -9 of every process during one leaves the checkpoint before it the newest, the ``.partial-``
directory unread."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from bpo_megatron import testing as th
from bpo_megatron.parallel.local_world import GlooWorldError, run_gloo_world
from bpo_megatron.trainer import checkpoint

TIMEOUT = 240
LAYOUT = dict(ep=2)  # two ranks that both write shards (the experts are split)
LR = 3e-3


def _step(actor, index: int) -> dict:
    return actor.train_step(th.make_samples(8, seed=index))


def _wait_for(path: Path, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} ({path}) did not appear within {timeout_s:.0f} s")
        time.sleep(0.05)


def _save_in_both_ways_and_train_on(blocking_root: str, background_root: str, hold: str) -> dict:
    """Two steps, the same state saved blocking and in the background (held: the next two steps
    train while it is in flight), two more steps; then the background save is let go."""
    actor = th.build_actor(lr=LR, **LAYOUT)
    metrics = [_step(actor, 0), _step(actor, 1)]
    actor.save(blocking_root)
    os.environ[checkpoint.TEST_HOLD_WRITER_ENV] = hold
    try:
        actor.save(background_root, background=True)
    finally:
        del os.environ[checkpoint.TEST_HOLD_WRITER_ENV]
    metrics += [_step(actor, 2), _step(actor, 3)]  # each polls the held save
    in_flight_while_training = actor.saves.in_flight and not (Path(background_root) / "step-00000002").exists()
    try:  # the wait for a save is bounded, and says what waited
        actor.saves.finish("the test waits half a second", timeout_s=0.5)
        timed_out = None
    except TimeoutError as exc:
        timed_out = str(exc)
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(hold) / "release").touch()
    published = actor.finish_saves()
    actor.close()
    return {"metrics": metrics, "in_flight_while_training": in_flight_while_training, "published": published,
            "timed_out": timed_out}


def _resume_each(roots: list[str]) -> list[dict]:
    out = []
    for root in roots:
        actor = th.build_actor(lr=LR, **LAYOUT)
        step = actor.load(root)["step"]
        out.append({"step": step, "metrics": [_step(actor, index) for index in range(step, 4)]})
        actor.close()
    return out


def _same(a: list[dict], b: list[dict]) -> None:
    for got, want in zip(a, b, strict=True):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"])


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_a_background_save_resumes_exactly_like_a_blocking_one(tmp_path):
    blocking, background, hold = (str(tmp_path / name) for name in ("blocking", "background", "hold"))
    os.mkdir(hold)
    straight = run_gloo_world(_save_in_both_ways_and_train_on, 2, blocking, background, hold, timeout=TIMEOUT)
    assert all(r["in_flight_while_training"] and r["published"] == 2 for r in straight), straight
    assert all(r["timed_out"] == "the background save of step 2 did not finish within 0.5 s (the test waits half a "
               "second); its directory stays a .partial- one, never read" for r in straight), straight
    assert sorted(p.name for p in Path(hold).iterdir()) == ["rank-00000.held", "rank-00001.held", "release"]
    for root in (blocking, background):
        assert (Path(root) / checkpoint.LATEST).read_text() == "step-00000002"
        assert checkpoint.damage(Path(root) / "step-00000002") == []  # every checksum matches
        assert not list(Path(root).glob(f"{checkpoint.PARTIAL_PREFIX}*"))
    # the two checkpoints hold the same bytes: the background one is the state at its save, not
    # the one the two steps trained while it was written
    manifests = [json.loads((Path(root) / "step-00000002" / checkpoint.integrity.MANIFEST).read_text())
                 for root in (blocking, background)]
    # the same files listed (those the background writer hashed itself among them, its own notes gone)
    assert sorted(manifests[1]) == sorted(manifests[0]) == sorted(
        str(f.relative_to(Path(background) / "step-00000002")) for f in (Path(background) / "step-00000002").rglob("*")
        if f.is_file() and f.name != checkpoint.integrity.MANIFEST)
    shards = {name for name in manifests[0] if name.endswith(".distcp")}
    assert shards and {name: manifests[1][name] for name in shards} == {name: manifests[0][name] for name in shards}
    from_blocking, from_background = run_gloo_world(_resume_each, 2, [blocking, background], timeout=TIMEOUT)[0]
    assert from_blocking["step"] == from_background["step"] == 2
    _same(from_background["metrics"], from_blocking["metrics"])
    _same(from_background["metrics"], straight[0]["metrics"][2:])


def _killed_during_a_background_save(root: str, hold: str) -> None:
    """A blocking save after one step, a held background save after the next, one more step,
    then every process of this rank (the writer, Megatron's result-queue manager, the rank)
    killed with SIGKILL while the writer is in flight."""
    actor = th.build_actor(lr=LR, **LAYOUT)
    _step(actor, 0)
    actor.save(root)
    _step(actor, 1)
    os.environ[checkpoint.TEST_HOLD_WRITER_ENV] = hold
    actor.save(root, background=True)
    _step(actor, 2)
    _wait_for(Path(hold) / f"rank-{dist.get_rank():05d}.held", "this rank's background writer")
    for child in multiprocessing.active_children():
        os.kill(child.pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _resume_and_continue(root: str) -> dict:
    """The run resumed from ``root`` beside the uninterrupted one (fresh weights, same seed)."""
    straight = th.build_actor(lr=LR, **LAYOUT)
    want = [_step(straight, 0), _step(straight, 1)]
    straight.close()
    actor = th.build_actor(lr=LR, **LAYOUT)
    step = actor.load(root)["step"]
    got = [_step(actor, index) for index in range(step, 2)]
    actor.save(root)  # step 2 again, blocking: the killed save's directory is cleared
    actor.close()
    return {"step": step, "got": got, "want": want[step:]}


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_a_kill_during_a_background_save_leaves_the_previous_checkpoint_the_newest(tmp_path):
    root, hold = tmp_path / "ckpt", tmp_path / "hold"
    hold.mkdir()
    with pytest.raises(GlooWorldError, match="rank process died"):
        run_gloo_world(_killed_during_a_background_save, 2, str(root), str(hold), timeout=TIMEOUT)
    writers = [int((hold / f"rank-{rank:05d}.held").read_text()) for rank in (0, 1)]
    for pid in writers:  # killed with their ranks: none lives on to finish the save
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    partial = root / f"{checkpoint.PARTIAL_PREFIX}step-00000002"
    assert sorted(p.name for p in root.iterdir()) == [partial.name, "latest", "step-00000001"]
    assert (root / checkpoint.LATEST).read_text() == "step-00000001"
    assert checkpoint.select(root).path == root / "step-00000001"  # verified against its checksums
    # the killed save wrote its shards and its trainer state (step 2); made unreadable, they
    # change nothing: the partial directory is never read
    written = [p for p in partial.rglob("*") if p.is_file()]
    assert any(p.suffix == ".distcp" for p in written) and (partial / checkpoint.STATE_FILE).is_file()
    # each writer hashed the shards it wrote (in the background, not at the publish)
    hashed = {name for rank in (0, 1) for name in json.loads((partial / f".digests-rank-{rank:05d}.json").read_text())}
    assert hashed == {p.name for p in written if p.suffix == ".distcp"}
    for path in written:
        path.write_bytes(b"not a checkpoint")
    resumed = run_gloo_world(_resume_and_continue, 2, str(root), timeout=TIMEOUT)[0]
    assert resumed["step"] == 1
    _same(resumed["got"], resumed["want"])
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000002"]


def _a_background_write_fails(root: str) -> dict:
    """A background save whose write fails (the disk full, say), finished; then a blocking save."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    actor = th.build_actor(lr=LR, **LAYOUT)
    _step(actor, 0)
    actor.save(root)
    _step(actor, 1)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    real_write, filesystem_async._write_item = filesystem_async._write_item, full_disk
    try:  # the writer forked by this save sees the failing write
        actor.save(root, background=True)
    finally:
        filesystem_async._write_item = real_write
    try:
        actor.finish_saves()
        error = None
    except Exception as exc:  # noqa: BLE001 - what every rank saw is the result
        error = f"{type(exc).__name__}: {exc}"
    after_failure = {"in_flight": actor.saves.in_flight, "latest": (Path(root) / checkpoint.LATEST).read_text(),
                     "listing": sorted(p.name for p in Path(root).iterdir())}
    _step(actor, 2)  # training goes on; the next save (blocking) succeeds
    actor.save(root)
    actor.close()
    return {"error": error, "after_failure": after_failure, "latest": (Path(root) / checkpoint.LATEST).read_text()}


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_failed_background_write_raises_on_every_rank_and_publishes_nothing(tmp_path):
    root = tmp_path / "ckpt"
    for result in run_gloo_world(_a_background_write_fails, 2, str(root), timeout=TIMEOUT):
        # megatron-core 0.16 passes the writer's error on; newer versions name only its class (the
        # worker prints the rest), so the loop tells a full disk by its free space, not the text
        assert result["error"] is not None and "the background save of step 2 failed" in result["error"], result
        assert "No space left on device" in result["error"] or "OSError" in result["error"], result
        assert result["after_failure"] == {"in_flight": False, "latest": "step-00000001",
                                           "listing": [".partial-step-00000002", "latest", "step-00000001"]}
        assert result["latest"] == "step-00000003"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000003"]


def _background_saves_that_fail_by_cause(root: str) -> dict:
    """Two background saves that fail, each finished: one whose writer process is killed (SIGKILL)
    before it writes anything, one whose writes fail with ENOSPC while the disk has less room than
    a checkpoint takes (its free space faked); then a blocking save."""
    import shutil as shutil_module
    from collections import namedtuple

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    actor = th.build_actor(lr=LR)
    _step(actor, 0)
    actor.save(root)
    errors = {}

    def killed_writer(write, directory, rank):  # the writer process Megatron forks, killed at its start
        return lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    usage = namedtuple("usage", "total used free")
    real_usage = shutil_module.disk_usage
    for cause, step in (("killed", 1), ("full", 2)):
        _step(actor, step)
        real_hashing, real_write = checkpoint._hashing_writer, filesystem_async._write_item
        if cause == "killed":
            checkpoint._hashing_writer = killed_writer
        else:
            filesystem_async._write_item = full_disk
        try:
            actor.save(root, background=True)
        finally:
            checkpoint._hashing_writer, filesystem_async._write_item = real_hashing, real_write
        if cause == "full":  # 1 MB free, less than the first checkpoint takes
            shutil_module.disk_usage = lambda path: usage(10**9, 10**9 - 10**6, 10**6)
        try:
            actor.finish_saves()
            errors[cause] = None
        except Exception as exc:  # noqa: BLE001 - the error is the result
            errors[cause] = (type(exc).__name__, getattr(exc, "errno", None), str(exc))
        finally:
            shutil_module.disk_usage = real_usage
    needed = checkpoint.checkpoint_bytes(Path(root) / "step-00000001")
    _step(actor, 3)
    actor.save(root)
    actor.close()
    return {"errors": errors, "needed": needed, "latest": (Path(root) / checkpoint.LATEST).read_text()}


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_background_save_that_fails_names_its_cause_a_killed_writer_or_a_full_disk(tmp_path):
    """A killed writer read as Megatron's "results_queue should not be empty", and a full disk
    during a background save was not named as one (a blocking save's was): the failure now says
    which writer was killed and by what, or that the disk is full (an ``OSError(ENOSPC)`` with
    the free space and a checkpoint's size, which the command reports as "no space left"), and the
    checkpoint before it stays the newest."""
    root = tmp_path / "ckpt"
    (result,) = run_gloo_world(_background_saves_that_fail_by_cause, 1, str(root), timeout=TIMEOUT)
    kind, code, killed = result["errors"]["killed"]
    assert kind == "RuntimeError" and killed.startswith(
        "the background save of step 2 failed: the checkpoint writer process of trainer rank 0 was killed by SIGKILL "
        "before it had written its files (its .partial- directory is never read; the checkpoint before it stays the "
        "newest. The writer's report: "), killed
    kind, code, full = result["errors"]["full"]
    assert (kind, code) == ("OSError", 28)
    assert (f"the background save of step 3 failed: No space left on device: 0.001 GB free on the device holding "
            f"{root}, a checkpoint takes about {result['needed'] / 1e9:.3f} GB (its .partial- directory") in full
    assert result["latest"] == "step-00000004"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000004"]


def test_the_command_names_a_full_disk_met_by_a_background_save(tmp_path, capsys):
    """What the command prints for a trainer rank whose background save failed on a full disk
    (the error above, surfacing at a training step's poll): the disk named, and how to resume."""
    from bpo_megatron.commands.common import report_failure
    from bpo_megatron.orchestration.groups import TrainerFailed

    failure = TrainerFailed("trainer rank 0 raised OSError: [Errno 28] the background save of step 3 failed: No space "
                            f"left on device: 0.001 GB free on the device holding {tmp_path}, a checkpoint takes about "
                            "0.004 GB", details="Traceback (most recent call last): ...")
    assert report_failure("bpo-megatron train", failure, ["bpo-megatron", "train", "x.yaml"], run_dir=tmp_path) == 1
    err = capsys.readouterr().err
    assert (f"bpo-megatron train: no space left on the device holding {tmp_path}; what was being written is incomplete "
            "and never read") in err
    assert err.rstrip().endswith("Free space there, then resume the run with: bpo-megatron train x.yaml")


def test_the_background_writer_imports_on_this_torch():
    """Megatron's checkpoint writer imports private names of torch's distributed checkpointing;
    run under each torch of the supported window (PYTHONPATH=.torch-oldest: 2.11; the SGLang
    venv: 2.14) this says whether they are all there, and the write function takes what the
    writer passes it."""
    import inspect

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    checkpoint.check_checkpoint_writer()
    writes = inspect.signature(filesystem_async._write_item).parameters
    assert {"stream", "data", "write_item", "storage_key"} <= set(writes)
    if "serialization_format" in writes:  # what the writer then passes
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        assert SerializationFormat.TORCH_SAVE


def test_the_loop_saves_in_the_background_unless_told_not_to():
    from bpo_megatron.config import ConfigError
    from bpo_megatron.experiment import load_experiment

    demo = Path(__file__).resolve().parents[1] / "configs" / "tiny_moe_cpu.yaml"
    assert load_experiment(demo).checkpoint.background is True
    assert load_experiment(demo, ["checkpoint.background=false"]).checkpoint.background is False
    with pytest.raises((ConfigError, ValueError), match="checkpoint.background"):
        load_experiment(demo, ["checkpoint.background=sometimes"])
