"""The distributed optimizer's state is saved by every data-parallel rank, each writing its own
shard (``optimizer_state.DP_SHARDS``), and resumes at another data-parallel size.

Megatron's distributed optimizer runs here on CPU in fp32 (``optimizer.distributed: true``, the
GPU path's optimizer and checkpoint format). A run at DP=2 saves after two steps (blocking, in
the background, and in the format of older checkpoints, gathered on DP rank 0) and trains two
more. Measured at the save: the bytes of optimizer state each rank puts into it, against the
rank's own shard and against what the gathered format holds on DP rank 0. Resumed at DP=2, DP=1
and DP=4, every parameter's fp32 master weight and Adam moments (reassembled from the ranks'
shards) equal the saved ones bit for bit; at DP=2 the continued run equals the uninterrupted
one bit for bit (at another DP size the gradient's reduction order differs, so it agrees within
fp32 rounding). At DP=4 the resumed state is saved again, measured the same way (each rank a
quarter), and that save resumed too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from bpo_megatron import testing as th
from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.trainer import optimizer_state

TIMEOUT = 300
STEPS = 2  # optimizer steps before the save, and again after it
LR = 3e-3  # large enough that Adam's moments shape the next steps visibly
PROBE = dict(count=8, seed=99)
FP32 = 4
STATE = ("param", "exp_avg", "exp_avg_sq")  # what the distributed optimizer keeps per element
ALIGNMENT = 64  # Megatron's buckets start every parameter at a multiple of 64 elements (the gaps are saved)


def _actor():
    return th.build_actor(lr=LR, distributed_optimizer=True)


def _step(actor, index: int) -> dict:
    return actor.train_step(th.make_samples(8, seed=index))


def _shards(actor) -> list[tuple[str, int, int, int, dict]]:
    """This rank's shard of the optimizer state: (parameter name, start, end, numel, tensors) for
    every parameter range the rank owns, straight from Megatron's distributed optimizer."""
    names = {param: name for name, param in actor.model.named_parameters()}
    out = []
    for inner in optimizer_state.inner_optimizers(actor.optimizer):
        for gbuf_range_maps in inner.gbuf_ranges:
            for buckets in gbuf_range_maps.values():
                for bucket in buckets:
                    for param, ranges in bucket["param_map"].items():
                        tensors = inner._get_main_param_and_optimizer_states(param)
                        out.append((names[param], ranges["param"].start, ranges["param"].end, param.numel(),
                                    {key: tensors[key].detach().clone() for key in (*STATE, "step")}))
    return out


def _assemble(per_rank: list[list]) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's state, whole, from the ranks' shards (each element owned exactly once)."""
    whole: dict[str, dict[str, torch.Tensor]] = {}
    covered: dict[str, torch.Tensor] = {}
    for shards in per_rank:
        for name, start, end, numel, tensors in shards:
            entry = whole.setdefault(name, {key: torch.full((numel,), float("nan")) for key in STATE})
            mask = covered.setdefault(name, torch.zeros(numel, dtype=torch.int64))
            mask[start:end] += 1
            for key in STATE:
                entry[key][start:end] = tensors[key]
            entry.setdefault("step", set()).add(float(tensors["step"]))
    for name, mask in covered.items():
        assert bool((mask == 1).all()), f"{name}: elements owned {mask.unique().tolist()} times"
    return whole


def _saved_bytes(actor, fmt: str) -> dict[str, int]:
    """What this rank puts into a save of the optimizer state in format ``fmt``: the bytes of the
    tensors it writes (its main replicas), and of those among them that are not the optimizer's
    own memory (allocated for the save: gathered state, padding)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    own = []
    for inner in optimizer_state.inner_optimizers(actor.optimizer):
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                for tensor in (param, *inner.optimizer.state[param].values()):
                    storage = tensor.untyped_storage()
                    own.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    part = optimizer_state.OptimizerState(actor.optimizer, actor.model.sharded_state_dict(prefix=""),
                                          is_loading=False, saved_format=fmt)
    written = fresh = 0
    for item in nested_values(part.sharded):
        if isinstance(item, ShardedTensor) and is_main_replica(item.replica_id):
            size = item.data.numel() * item.data.element_size()
            written += size
            if not any(lo <= item.data.data_ptr() < hi for lo, hi in own):
                fresh += size
    return {"written": written, "fresh": fresh}


def _probe(actor) -> list:
    return actor.compute_logprobs(th.make_samples(**PROBE)).logprobs


def _save_midway(roots: dict) -> dict:
    """The uninterrupted run at DP=2: two steps, the same state saved blocking, in the background
    and in the gathered format of older checkpoints, two more steps."""
    actor = _actor()
    for index in range(STEPS):
        _step(actor, index)
    shards = _shards(actor)
    measured = {fmt: _saved_bytes(actor, fmt) for fmt in (optimizer_state.DP_SHARDS, optimizer_state.GATHERED)}
    actor.save(roots["blocking"])
    actor.save(roots["background"], background=True)
    gathered_format = optimizer_state.save_format
    optimizer_state.save_format = lambda optimizer: optimizer_state.GATHERED  # as saves before DP_SHARDS wrote
    try:
        actor.save(roots["gathered"])
    finally:
        optimizer_state.save_format = gathered_format
    metrics = [_step(actor, STEPS + index) for index in range(STEPS)]  # the first publishes the background save
    actor.finish_saves()
    out = {"shards": shards, "measured": measured, "metrics": metrics, "logprobs": _probe(actor),
           "dp": actor.ranks.dp}
    actor.close()
    return out


def _resume(roots: list[str], save_to: str | None = None) -> list[dict]:
    """Each of ``roots`` loaded and trained on; with ``save_to`` the first one, once loaded, is
    saved again at this DP size (measured) and ``save_to`` is resumed last."""
    out = []
    for root in [*roots, *([save_to] if save_to else [])]:
        actor = _actor()
        actor.load(root)
        shards = _shards(actor)
        measured = None
        if save_to and root == roots[0]:
            measured = _saved_bytes(actor, optimizer_state.DP_SHARDS)
            actor.save(save_to)
        metrics = [_step(actor, STEPS + index) for index in range(STEPS)]
        out.append({"shards": shards, "metrics": metrics, "logprobs": _probe(actor), "step": actor.step,
                    "measured": measured})
        actor.close()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("dp_shards")
    roots = {name: str(base / name) for name in ("blocking", "background", "gathered")}
    ranks = run_gloo_world(_save_midway, 2, roots, timeout=TIMEOUT)
    return {"roots": roots, "ranks": ranks, "state": _assemble([r["shards"] for r in ranks])}


def _same_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name]["step"] == want[name]["step"] == {float(STEPS)}, name
        for key in STATE:
            assert torch.equal(got[name][key], want[name][key]), (name, key)


def test_each_rank_saves_its_own_shard_and_no_rank_gathers(saved):
    """Measured at DP=2: each rank writes its own shard plus the alignment gaps of its ranges; the
    gathered format puts all of it on DP rank 0."""
    ranks = sorted(saved["ranks"], key=lambda r: r["dp"])
    total = sum(tensor.numel() for tensors in saved["state"].values() for key, tensor in tensors.items()
                if key in STATE) * FP32
    assert sum(_own_and_gaps(r["shards"])[0] for r in ranks) == total
    for rank in ranks:
        own, gaps = _own_and_gaps(rank["shards"])
        ours = rank["measured"][optimizer_state.DP_SHARDS]
        assert own <= ours["written"] <= own + gaps, (ours, own, gaps)
        # allocated for the save: the gaps, and on a CPU a compact copy of the shard's fp32 master
        # weights (views into the model's parameter buffer, which the writer would copy itself);
        # on a GPU the writer stages the written bytes from the device, nothing more
        assert ours["fresh"] == ours["written"] - own + own // len(STATE), (ours, own)
        assert own < 0.6 * total  # a shard, not the whole
    gathered = [r["measured"][optimizer_state.GATHERED] for r in ranks]
    # the older format: DP rank 0 holds every parameter's state, freshly gathered; DP rank 1 none
    assert gathered[0]["fresh"] == gathered[0]["written"] == total
    assert gathered[1]["written"] == 0
    assert max(r["measured"][optimizer_state.DP_SHARDS]["written"] for r in ranks) < 0.6 * gathered[0]["written"]


def test_resumed_at_dp2_continues_the_uninterrupted_run_bit_for_bit(saved):
    roots = saved["roots"]
    runs = run_gloo_world(_resume, 2, [roots["blocking"], roots["background"]], timeout=TIMEOUT)
    straight = saved["ranks"][0]
    for index, root in enumerate(("blocking", "background")):
        _same_state(_assemble([r[index]["shards"] for r in runs]), saved["state"])
        resumed = runs[0][index]
        assert resumed["step"] == 2 * STEPS, root
        for got, want in zip(resumed["metrics"], straight["metrics"], strict=True):
            assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), root
        assert all(torch.equal(a, b) for a, b in zip(resumed["logprobs"], straight["logprobs"], strict=True)), root


def _own_and_gaps(shards: list) -> tuple[int, int]:
    """The bytes of a rank's shard and the most its alignment gaps can add."""
    own = sum((end - start) * len(STATE) * FP32 for _, start, end, _, _ in shards)
    return own, len(shards) * (ALIGNMENT - 1) * len(STATE) * FP32


@pytest.mark.parametrize("world", [1, 4], ids=["dp1", "dp4"])
def test_resumed_at_another_dp_size_holds_the_saved_state_bit_for_bit(saved, world, tmp_path):
    roots = saved["roots"]
    # the older, gathered format loads too (at DP=1: under any layout); at DP=4 the resumed state
    # is saved again (measured) and that save resumed as well
    names = ["blocking", "gathered"] if world == 1 else ["blocking"]
    save_to = str(tmp_path / "dp4") if world == 4 else None
    runs = run_gloo_world(_resume, world, [roots[name] for name in names], save_to, timeout=TIMEOUT)
    if save_to:
        names.append("saved at DP=4")
        total = sum(_own_and_gaps(r[0]["shards"])[0] for r in runs)
        for rank in runs:
            own, gaps = _own_and_gaps(rank[0]["shards"])
            assert own <= rank[0]["measured"]["written"] <= own + gaps, (rank[0]["measured"], own, gaps)
            assert own < 0.3 * total  # a quarter, not the whole
    straight = saved["ranks"][0]
    for index, name in enumerate(names):
        _same_state(_assemble([r[index]["shards"] for r in runs]), saved["state"])
        resumed = runs[0][index]
        assert resumed["step"] == 2 * STEPS, name
        for got, want in zip(resumed["metrics"], straight["metrics"], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7), name
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), name
        gap = max(float((a - b).abs().max()) for a, b in zip(resumed["logprobs"], straight["logprobs"], strict=True))
        assert gap < 1e-4, (name, gap)


def _distributed_stand_in():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return SimpleNamespace(chained_optimizers=[DistributedOptimizer.__new__(DistributedOptimizer)])


def test_a_resume_under_another_model_parallel_layout_is_refused_by_name():
    saved_layout = {"tp": 1, "pp": 1, "ep": 1, "etp": 1, "dp": 2}
    optimizer = _distributed_stand_in()
    # any data-parallel size reads it
    optimizer_state.check_readable("ckpt", optimizer_state.DP_SHARDS, saved_layout, optimizer, {**saved_layout, "dp": 4})
    with pytest.raises(ValueError) as refused:
        optimizer_state.check_readable("ckpt", optimizer_state.DP_SHARDS, saved_layout, optimizer,
                                       {**saved_layout, "ep": 2, "dp": 1})
    message = str(refused.value)
    assert "saved with parallel.ep=1 and this run has parallel.ep=2" in message
    assert "Resume with parallel.ep=1 (any data-parallel size)" in message and "load_optimizer=False" in message
    # the older gathered format reshards under any layout
    optimizer_state.check_readable("ckpt", optimizer_state.GATHERED, saved_layout, optimizer,
                                   {**saved_layout, "ep": 2, "dp": 1})
    # the fp32 optimizer does not read the distributed one's shards
    from megatron.core.optimizer.optimizer import FP32Optimizer

    fp32 = SimpleNamespace(chained_optimizers=[FP32Optimizer.__new__(FP32Optimizer)])
    with pytest.raises(ValueError, match="holds megatron-dp-shards optimizer state, which this per-parameter optimizer "
                                         "does not read; it loads into the distributed optimizer"):
        optimizer_state.check_readable("ckpt", optimizer_state.DP_SHARDS, saved_layout, fp32, saved_layout)


def test_a_run_resumed_under_another_model_parallel_layout_is_refused_before_it_starts(tmp_path):
    """The preflight reads the checkpoint's format and layout (nothing starts)."""
    import json
    from pathlib import Path

    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.loop.preflight import resume_point
    from bpo_megatron.loop.run_dir import RunRefused
    from bpo_megatron.parallel import layout_record
    from bpo_megatron.trainer import checkpoint

    cfg = load_experiment(Path(__file__).resolve().parents[1] / "configs" / "tiny_moe_cpu.yaml",
                          [f"logging.run_dir={tmp_path / 'run'}"])
    step = tmp_path / "run" / "checkpoints" / checkpoint.step_dir_name(4)
    step.mkdir(parents=True)
    run = layout_record(cfg.parallel, cfg.cluster.trainer_ranks)
    assert run["ep"] == 2
    saved = {**run, "ep": 1}
    meta = {"step": 4, "rl_step": 4, "data_cursor": 16, "sft_done": True, "optimizer_state": True,
            "optimizer_format": optimizer_state.DP_SHARDS, "layout": saved}
    (step / checkpoint.STATE_FILE).write_text(json.dumps(meta))
    with pytest.raises(RunRefused, match=r"it was saved with parallel\.ep=1 and this run has parallel\.ep=2\. Resume "
                                         r"with parallel\.ep=1 \(any data-parallel size\)"):
        resume_point(cfg, cfg.hf_config())
    # the same layout but another data-parallel size resumes
    (step / checkpoint.STATE_FILE).write_text(json.dumps({**meta, "layout": {**run, "dp": run["dp"] + 3}}))
    state, _, _ = resume_point(cfg, cfg.hf_config())
    assert state.data_cursor == 16
