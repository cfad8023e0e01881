"""Atomic, resharding checkpoints of the trainer (Megatron-Core distributed checkpointing).

Layout under a checkpoint root::

    root/latest                  name of the newest complete checkpoint ("step-00000012")
    root/step-00000012/          Megatron dist_checkpointing of {"model", "optimizer"}
        trainer_state.json       step, data cursor and anything else the caller passes
        mtp/                     multi-token-prediction layers carried beside the model, if any
                                 (Hugging Face safetensors, bpo_megatron.weights.mtp)
        rng/rank-00003.pt        this rank's RNG states (restored only under the same layout)
        checksums.json           size and SHA-256 of every other file
    root/.partial-step-00000013  a save in progress; never read

A save writes into the ``.partial-`` directory, renames it into place and only then moves the
``latest`` marker (write to a temporary file, fsync, ``os.replace``), so a process killed at any
point leaves the previous checkpoint loadable. The newest step directory is the checkpoint of a
root, whatever ``latest`` says; a damaged one (checksums, torn state) is refused by name, never
skipped. Model tensors, and the fp32 optimizer's moments, are saved with their global shapes, so
such a checkpoint loads under a different TP/EP/PP layout.

A save either blocks until the checkpoint is published or, with a :class:`BackgroundSaves`,
returns once this rank's tensors are staged (copied to host memory on a GPU; on a CPU the
writer's forked process holds a copy-on-write image of them) and a background process writes
them. The publish steps (checksums, the rename into place, the ``latest`` marker, pruning) run
when the write is done, at a point where every rank polls, so a background save is published
exactly as a blocking one and a process killed while it writes leaves the previous checkpoint
the newest. At most one save is in flight: the next save, a load and the end of training wait
for it first.

The distributed optimizer (GPUs) is saved by every data-parallel rank, each writing its own shard
of the state and nothing more (:mod:`bpo_megatron.trainer.optimizer_state`): no rank gathers, and
a node holds at most what ``bpo-megatron plan`` prints as its host memory at a checkpoint save.
It resumes at any data-parallel size; the model-parallel layout stays as saved.
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from bpo_megatron import platform
from bpo_megatron.trainer import integrity, optimizer_state
from bpo_megatron.trainer.optimizer_state import OptimizerState

LATEST = "latest"
PARTIAL_PREFIX = ".partial-"
STATE_FILE = "trainer_state.json"
# How long finishing a background save may take (the write of the largest checkpoints at disk speed).
BACKGROUND_SAVE_TIMEOUT_S = 3 * 3600.0
_POLL_INTERVAL_S = 0.05
_DIGESTS_PREFIX = ".digests-rank-"  # checksums a background writer computed (consumed at the publish)
# Test-only: a directory that makes each background writer, once it has written its rank's files,
# say so (``rank-00000.held`` holding its process id) and wait for ``release`` there (tests that
# kill a save in flight, or train while one is held). Never set outside the test suite.
TEST_HOLD_WRITER_ENV = "BPO_MEGATRON_TEST_HOLD_CHECKPOINT_WRITER"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class DamagedCheckpoint(ValueError):
    """The newest checkpoint is damaged; the message names what and the intact one before it."""


@dataclass(frozen=True)
class Selection:
    """The checkpoint a root resolves to (None: there is none yet) and what the user should
    know about how it was found."""

    path: Path | None
    notes: tuple[str, ...] = ()


def step_of(directory: Path) -> int | None:
    name = directory.name
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def step_dirs(root: Path) -> list[Path]:
    """The step directories under ``root`` (saves in progress excluded), oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) is not None), key=step_of)


def damage(directory: Path, *, verify: bool = True) -> list[str]:
    """What makes a step directory unusable: its trainer state missing or torn, and (``verify``)
    files that do not match the checksums written at save."""
    state = directory / STATE_FILE
    if not state.is_file():
        return [f"{state} is missing"]
    try:
        json.loads(state.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return [f"{state} is damaged ({exc})"]
    return integrity.problems(directory) if verify else []


def select(path: str | Path, *, verify: bool = True) -> Selection:
    """The checkpoint to load from ``path``: a step directory itself, or under a root the newest
    step directory. ``latest`` only names it; when ``latest`` is missing or names something else
    (a driver killed between the rename and the marker), the newest step directory is used and
    a note says so. A damaged newest checkpoint raises :class:`DamagedCheckpoint` naming the
    damage and the newest intact checkpoint before it — never a silent fallback or fresh start.
    """
    path = Path(path)
    if step_of(path) is not None or (path / STATE_FILE).is_file():
        problems = damage(path, verify=verify)
        if problems:
            raise DamagedCheckpoint(f"checkpoint {path} is damaged:\n  " + "\n  ".join(problems))
        return Selection(path)
    candidates = step_dirs(path)
    if not candidates:
        return Selection(None)
    newest = candidates[-1]
    notes = []
    marker = path / LATEST
    named = marker.read_text().strip() if marker.is_file() else None
    if named is None:
        notes.append(f"{marker} is missing; the newest checkpoint, {newest.name}, is used")
    elif named != newest.name:
        notes.append(f"{marker} names {named!r} but the newest checkpoint is {newest.name}, which is used")
    problems = damage(newest, verify=verify)
    if problems:
        intact = next((c for c in reversed(candidates[:-1]) if not damage(c, verify=verify)), None)
        way_out = (f"the checkpoint before it, {intact.name}, is intact: move {newest.name} aside "
                   f"(mv {newest} {path / ('damaged-' + newest.name)}) to resume from {intact.name}"
                   if intact else "no earlier checkpoint is intact: restore it from a copy, or start a new run")
        raise DamagedCheckpoint(f"checkpoint {newest} is damaged:\n  " + "\n  ".join(problems) + f"\n{way_out}")
    return Selection(newest, tuple(notes))


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from a root (its newest checkpoint) or from a step directory
    itself (structure only; :func:`select` also verifies the checksums)."""
    chosen = select(path, verify=False).path
    if chosen is None:
        raise FileNotFoundError(f"no checkpoint at {path}: expected step directories holding {STATE_FILE}, "
                                f"or such a step directory itself")
    return chosen


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _restore_rng(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(model: torch.nn.Module, optimizer, *, is_loading: bool, saved_format: str | None = None
                   ) -> tuple[dict[str, Any], OptimizerState | None]:
    model_state = model.sharded_state_dict(prefix="")
    state: dict[str, Any] = {"model": model_state}
    optimizer_part = None
    if optimizer is not None:
        optimizer_part = OptimizerState(optimizer, model_state, is_loading=is_loading, saved_format=saved_format)
        state["optimizer"] = optimizer_part.sharded
    return state, optimizer_part


NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device", as a failure's text carries it
NO_SPACE_MARGIN_BYTES = 64 * 2**20  # free space below which a failed first save is put down to a full disk


def space_shortfall(root: str | Path) -> str | None:
    """Why a save under ``root`` that failed failed for want of space, or None: the device holding
    it has less free space than a checkpoint takes (the newest complete one's size; before the
    first, ``NO_SPACE_MARGIN_BYTES``). A write cut short by a full disk surfaces in many forms (an
    ``OSError``, a writer's exception passed on as text, a worker that died), so the disk is
    asked, not the error."""
    root = Path(root)
    complete = [d for d in step_dirs(root) if checkpoint_bytes(d)] if root.is_dir() else []
    needed = checkpoint_bytes(complete[-1]) if complete else NO_SPACE_MARGIN_BYTES
    free = shutil.disk_usage(root if root.is_dir() else root.parent).free
    if free >= needed:
        return None
    return (f"{NO_SPACE}: {free / 1e9:.3f} GB free on the device holding {root}, a checkpoint takes about "
            f"{needed / 1e9:.3f} GB")


def checkpoint_bytes(directory: Path) -> int:
    """The bytes of a saved checkpoint's files, as its checksum manifest records them (0 if it has none)."""
    manifest = directory / integrity.MANIFEST
    if not manifest.is_file():
        return 0
    return sum(int(entry["bytes"]) for entry in json.loads(manifest.read_text()).values())


class BackgroundSaves:
    """The save of this rank writing in the background, if any (at most one; see the module
    docstring). Every method is collective: every rank calls it at the same point."""

    def __init__(self) -> None:
        check_checkpoint_writer()
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        # Megatron's persistent worker is a spawned process that selects a CUDA device; the
        # temporal caller forks this process per save, which works on CPUs and GPUs alike
        self._queue = AsyncCallsQueue(persistent=False)
        self.step: int | None = None  # the step being written
        self.root: Path | None = None  # the checkpoint root it is written under
        self.waited_s = 0.0  # how long the last save waited for the one before it to finish
        self.staged_s = 0.0  # how long the last save took before it returned (the step's share)
        self._writer = None  # the writer process Megatron forked for the save in flight (its exit status)

    @property
    def in_flight(self) -> bool:
        return self.step is not None

    def start(self, request, step: int, root: str | Path) -> None:
        self._queue.schedule_async_request(request)
        self.step, self.root = step, Path(root)
        caller = self._queue.async_calls[-1].async_caller if self._queue.async_calls else None
        self._writer = getattr(caller, "process", None)  # Megatron closes its own reference when done

    def poll(self) -> int | None:
        """Publish the save in flight if every rank's writer is done; the step published, if any."""
        if not self.in_flight:
            return None
        self._finalize_if_done()
        return self._published()

    def finish(self, why: str, timeout_s: float = BACKGROUND_SAVE_TIMEOUT_S) -> int | None:
        """Wait for the save in flight and publish it (``why``: what needs it finished, named if
        it takes longer than ``timeout_s``); the step published, if any."""
        if not self.in_flight:
            return None
        start = time.monotonic()
        while self._queue.get_num_unfinalized_calls():
            self._finalize_if_done()
            if not self._queue.get_num_unfinalized_calls():
                break
            # decided together, so every rank leaves the loop at the same poll
            expired = torch.tensor([float(time.monotonic() - start > timeout_s)], device=platform.device())
            dist.all_reduce(expired, op=dist.ReduceOp.MAX)
            if expired.item():
                raise TimeoutError(f"the background save of step {self.step} did not finish within {timeout_s:g} s "
                                   f"({why}); its directory stays a {PARTIAL_PREFIX} one, never read")
            time.sleep(_POLL_INTERVAL_S)
        return self._published()

    def _finalize_if_done(self) -> None:
        """Megatron's finalisation, then ours (the publish), if every rank's writer is done; a
        save that failed (a rank's write, the publish) raises on every rank and is no longer in
        flight, its directory left a partial one."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            self._queue.maybe_finalize_async_calls(blocking=False)
        except CheckpointException as exc:  # a BaseException; raised on every rank, but detailed on rank 0
            step, self.step = self.step, None
            # what the disk says, on rank 0 (so every rank raises alike); every rank's writer's exit status
            reported = [str(exc), space_shortfall(self.root) if self.root is not None else None]
            dist.broadcast_object_list(reported, src=0)
            exits: list = [None] * dist.get_world_size()
            dist.all_gather_object(exits, getattr(self._writer, "exitcode", None))
            detail, shortfall = reported
            cause = _failed_save_cause(shortfall, exits, detail)
            message = (f"the background save of step {step} failed: {cause} (its {PARTIAL_PREFIX} directory is never "
                       f"read; the checkpoint before it stays the newest. The writer's report: {detail.strip()})")
            if shortfall is not None or NO_SPACE in detail:
                raise OSError(errno.ENOSPC, message, str(self.root)) from exc
            raise RuntimeError(message) from exc
        except BaseException:
            if not self._queue.get_num_unfinalized_calls():
                self.step = None
            raise

    def _published(self) -> int | None:
        if self._queue.get_num_unfinalized_calls():
            return None
        step, self.step = self.step, None
        return step


def _failed_save_cause(shortfall: str | None, exits: list, detail: str) -> str:
    """What made a background save fail, in words: a full disk (``shortfall``, or the writer's
    report saying so), a writer process that was killed or exited with an error before it handed
    back its results (``exits``: each rank's writer's exit status), or else the writer's error."""
    if shortfall is not None:
        return shortfall
    if NO_SPACE in detail:
        return f"{NO_SPACE} (the writer's report)"
    dead = []
    for rank, code in enumerate(exits):
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            dead.append(f"the checkpoint writer process of trainer rank {rank} was killed by {name}")
        elif code:
            dead.append(f"the checkpoint writer process of trainer rank {rank} exited with status {code}")
    if dead:
        return "; ".join(dead) + " before it had written its files"
    return "the checkpoint writer raised an error"


def check_checkpoint_writer() -> None:
    """Megatron's checkpoint writer (blocking saves run it too) imports private names of torch's
    distributed checkpointing; refuse up front, naming the one missing, on a torch that lacks
    one, rather than at the first save."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver  # noqa: F401
        from megatron.core.dist_checkpointing.strategies import torch as torch_strategy  # noqa: F401
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"checkpoint saves need Megatron-Core's distributed-checkpoint writer, which does not "
                           f"import with torch {torch.__version__} ({exc}); use a torch of the window the package "
                           "supports (pyproject.toml)") from exc


def save(root: str | Path, step: int, model: torch.nn.Module, optimizer, trainer_state: dict[str, Any],
         *, layout: dict[str, int], keep_last: int | None = None, background: BackgroundSaves | None = None,
         beside: Callable[[Path], None] | None = None) -> Path:
    """Collectively save ``model`` (the unwrapped GPTModel chunk) and ``optimizer`` (every rank calls).

    With ``background`` the save returns once the tensors are staged and is published later
    (:meth:`BackgroundSaves.poll`, :meth:`BackgroundSaves.finish`); the directory returned exists
    only then. A save still in flight is finished first. ``beside`` writes files that travel with
    the model but are not its parameters (the multi-token-prediction layers,
    :mod:`bpo_megatron.weights.mtp`) into the step directory: rank 0 calls it before returning,
    and they are checksummed and published with the rest.
    """
    from megatron.core import dist_checkpointing

    root = Path(root)
    if background is not None:
        start = time.perf_counter()
        background.finish(why=f"the checkpoint of step {step} waits for it")
        background.waited_s = time.perf_counter() - start
    start = time.perf_counter()
    if optimizer is not None and not optimizer_state.has_state(optimizer):
        optimizer = None  # before the first step there is nothing but the model to save
    final = root / step_dir_name(step)
    partial = root / f"{PARTIAL_PREFIX}{final.name}"
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{PARTIAL_PREFIX}*"):  # left by saves that were killed
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()
    dist.barrier()
    request = dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False)[0], str(partial),
                                      async_sharded_save=background is not None, **_async_writer(dist_checkpointing.save))
    if beside is not None and rank == 0:
        beside(partial)
    # the RNG and trainer state of this step, written now: the step saved is this one
    (partial / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), partial / "rng" / f"rank-{rank:05d}.pt")
    if rank == 0:
        meta = {"step": step, "layout": layout, "world_size": dist.get_world_size(),
                "optimizer_state": optimizer is not None, **trainer_state}
        if optimizer is not None:
            meta["optimizer_format"] = optimizer_state.save_format(optimizer)
            meta["optimizer_parts"] = len(optimizer_state.inner_optimizers(optimizer))
        _write_atomically(partial / STATE_FILE, json.dumps(meta, indent=2, sort_keys=True))

    def publish() -> None:
        dist.barrier()
        _write_checksums(partial, rank, dist.get_world_size())
        dist.barrier()
        if rank == 0:
            if final.exists():  # re-saving a step: the old copy goes only once the new one is whole
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(root)
            _write_atomically(root / LATEST, final.name)
            if keep_last:
                _prune(root, keep_last)
        dist.barrier()

    if background is None:
        publish()
        return final
    # after Megatron's own finalisation (its .metadata and metadata.json, once every rank wrote)
    request.add_finalize_fn(publish)
    if request.async_fn is not None:
        writer = _hashing_writer(request.async_fn, partial, rank)
        hold = os.environ.get(TEST_HOLD_WRITER_ENV)
        if hold:
            writer = _held_writer(writer, Path(hold), rank)
        request = request._replace(async_fn=writer)
    # at once, before the next optimizer step changes what the writer's fork sees
    background.start(request, step, root)
    background.staged_s = time.perf_counter() - start
    return final


def _async_writer(save: Callable) -> dict[str, str]:
    """The background writer Megatron's ``save`` is asked for: its own (``"mcore"``, the only one
    megatron-core 0.16 has). Newer versions take ``async_strategy`` and default it to ``"nvrx"``,
    which needs nvidia-resiliency-ext (not a dependency of this package)."""
    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(save).parameters else {}


def _hashing_writer(write: Callable, directory: Path, rank: int) -> Callable:
    """Megatron's writer (called with this rank, its write buckets and a results queue), then the
    checksums of the files it wrote, computed in the background too and left beside them for the
    publish (:func:`_write_checksums`), which would otherwise hash them on the training thread."""

    def hashing(rank_arg, buckets, *rest, **kwargs) -> None:
        write(rank_arg, buckets, *rest, **kwargs)
        names = [str(Path(bucket[0]).relative_to(directory)) for bucket in buckets]
        try:
            digests = integrity.digests(directory, names)
        except OSError:
            return  # a failed write: Megatron reports it at the publish, which then hashes nothing
        _write_atomically(directory / f"{_DIGESTS_PREFIX}{rank:05d}.json", json.dumps(digests))

    return hashing


def _held_writer(write: Callable, hold: Path, rank: int) -> Callable:
    """Test-only (:data:`TEST_HOLD_WRITER_ENV`): the writer announces itself once its files are
    written and waits for ``release`` (at most ten minutes, then goes on)."""

    def held(*args, **kwargs) -> None:
        write(*args, **kwargs)
        (hold / f"rank-{rank:05d}.held").write_text(str(os.getpid()))
        deadline = time.monotonic() + 600
        while not (hold / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    return held


def _write_checksums(directory: Path, rank: int, world_size: int) -> None:
    """Every rank hashes its share of the files (but those a background writer hashed already);
    rank 0 writes the manifest (before the rename, so a checkpoint in place always has one)."""
    hashed: dict = {}
    for found in sorted(directory.glob(f"{_DIGESTS_PREFIX}*")):
        hashed.update(json.loads(found.read_text()))
    names = [n for n in integrity.files_of(directory) if n not in hashed and not n.startswith(_DIGESTS_PREFIX)]
    share = integrity.digests(directory, names[rank::world_size])
    shares: list = [None] * world_size
    dist.all_gather_object(shares, share)
    if rank == 0:
        for found in directory.glob(f"{_DIGESTS_PREFIX}*"):  # every rank has read them
            found.unlink()
        integrity.write_manifest(directory, {**hashed, **{k: v for part in shares for k, v in part.items()}})


def _prune(root: Path, keep_last: int) -> None:
    """Keep the ``keep_last`` newest complete checkpoints, by step number, and the best one.

    The best step is the ``best_step`` the newest checkpoint's trainer state records (the RL
    loop's best-checkpoint rule, see ``bpo_megatron.eval.avg_at_k.BestCheckpoint``): the
    checkpoint a run reports as its result must outlive ``keep_last``. An older best is pruned
    like any other once a later step beats it.
    """
    complete = [p for p in step_dirs(root) if (p / STATE_FILE).is_file()]
    best = None
    if complete:
        try:
            best = json.loads((complete[-1] / STATE_FILE).read_text()).get("best_step")
        except (OSError, ValueError):
            best = None  # a state torn after its save: keep only the newest ones
    for old in complete[:-keep_last]:
        if step_of(old) != best:
            shutil.rmtree(old, ignore_errors=True)


def _verify_collectively(directory: Path) -> None:
    """Each rank checks its share of the files against the checksums; any damage anywhere
    raises :class:`DamagedCheckpoint` on every rank (none starts loading a damaged checkpoint)."""
    found = integrity.problems(directory, share=(dist.get_rank(), dist.get_world_size()))
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, found)
    problems = [p for part in everything for p in part]
    if problems:
        raise DamagedCheckpoint(f"checkpoint {directory} is damaged:\n  " + "\n  ".join(problems))


def _check_optimizer_format(directory: Path, meta: dict[str, Any], optimizer, layout: dict[str, int]) -> str:
    """The format of a checkpoint's optimizer state, refused by name unless this optimizer under
    ``layout`` reads it (see :mod:`bpo_megatron.trainer.optimizer_state`)."""
    saved = meta.get("optimizer_format", optimizer_state.GATHERED)
    if saved not in optimizer_state.FORMATS:
        raise ValueError(f"{directory} holds optimizer state of an unknown format {saved!r} (known: "
                         f"{', '.join(optimizer_state.FORMATS)}): it was written by a newer version of bpo-megatron; "
                         "load it with that version, or without the optimizer state (load_optimizer=False)")
    optimizer_state.check_readable(directory, saved, meta.get("layout", {}), optimizer, layout)
    parts = len(optimizer_state.inner_optimizers(optimizer))
    if saved != optimizer_state.PER_PARAMETER and meta.get("optimizer_parts", parts) != parts:
        raise ValueError(f"{directory} was saved by an optimizer of {meta['optimizer_parts']} parts (dense and expert "
                         f"parameters apart or together: expert parallelism on or off) and this one has {parts}; "
                         "resume with expert parallelism as it was saved (parallel.ep = 1, or > 1)")
    return saved


def load(path: str | Path, model: torch.nn.Module, optimizer, *, layout: dict[str, int],
         verify: bool = True) -> dict[str, Any]:
    """Collectively load a checkpoint (resharding to this layout); returns the trainer state.
    ``verify``: check the files against the checksums written at save first.

    RNG states are restored only when the layout is the one that saved them (otherwise each rank
    keeps the RNG it was seeded with; training uses no dropout, so results do not depend on it).
    """
    from megatron.core import dist_checkpointing

    directory = resolve(path)
    if verify:
        _verify_collectively(directory)
    meta = json.loads((directory / STATE_FILE).read_text())
    if not meta.get("optimizer_state", False):
        optimizer = None  # saved before the first step: a fresh optimizer is the right state
    saved_format = None
    if optimizer is not None:
        saved_format = _check_optimizer_format(directory, meta, optimizer, layout)
    sharded, optimizer_part = _sharded_state(model, optimizer, is_loading=True, saved_format=saved_format)
    state = dist_checkpointing.load(sharded, str(directory))
    model.load_state_dict(state["model"], strict=True)
    if optimizer_part is not None:
        optimizer_part.restore(state["optimizer"])
    same_layout = meta.get("layout") == layout and meta.get("world_size") == dist.get_world_size()
    rng_file = directory / "rng" / f"rank-{dist.get_rank():05d}.pt"
    if same_layout and rng_file.is_file():
        _restore_rng(torch.load(rng_file, weights_only=False))
    return meta
