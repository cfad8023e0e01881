"""A checkpoint save stays within a node's host memory (the distributed optimizer).

The state each rank writes, measured on a real distributed optimizer, is in
test_checkpoint_dp_shards.py. This checks the boundary with Megatron: a save asks Megatron for
its DP-reshardable format (each rank its own shard, no gather) and a load of an older checkpoint
for the fully reshardable one (gathered on DP rank 0 alone at its save); Megatron (the pinned
version, and the newest with ``PYTHONPATH=.megatron-newest``) branches on exactly those keys; and
host state that is a slice of a larger tensor reaches Megatron's writer compact, so the writer
copies none of it while the checkpoint's contents stay the same. The host-memory arithmetic is in
test_planner.py; the offload buffers dropped before a save in test_trainer_offload.py.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch

from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.trainer.optimizer_state import (DP_SHARDS, GATHERED, MEGATRON_METADATA, OptimizerState,
                                                  compact_host_views)

MEM_EFFICIENT = "distrib_optim_fully_reshardable_mem_efficient"


class _RecordingState:
    """What the stand-in below does in place of Megatron's distributed optimizer: records what a
    save or load asks it for and hands over host state that is slices of one host tensor."""

    def __init__(self) -> None:
        self.chained_optimizers = [self]
        self.optimizer = SimpleNamespace(state={0: {}})  # it has stepped: nothing to initialise at a load
        self.calls: list[dict] = []
        self.gathered = torch.arange(10.0)

    def sharded_state_dict(self, model_state, is_loading=False, metadata=None):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        self.calls.append({"is_loading": is_loading, "metadata": metadata})
        first, second = self.gathered[:4], self.gathered[4:]
        return {"param_state": {0: {"exp_avg": ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.a", first)},
                                1: {"exp_avg": ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.b", second)}},
                "param_state_sharding_type": (metadata or {}).get("distrib_optim_sharding_type")}


def _recording_distributed_optimizer():
    """A DistributedOptimizer (the type decides the checkpoint format) whose every method that a
    save or load calls is :class:`_RecordingState`'s."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class Recording(_RecordingState, DistributedOptimizer):
        pass

    return Recording()


def test_the_save_asks_megatron_for_each_ranks_own_shard_and_an_older_load_for_the_gathered_format():
    optimizer = _recording_distributed_optimizer()
    saved = OptimizerState(optimizer, {}, is_loading=False)
    assert optimizer.calls == [{"is_loading": False, "metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}]
    # what is saved is compact: no tensor is a slice of the gathered one any more
    for entry in saved.sharded["param_state"].values():
        data = entry["exp_avg"].data
        assert data.untyped_storage().nbytes() == data.numel() * 4
        assert not (optimizer.gathered.data_ptr() <= data.data_ptr() < optimizer.gathered.data_ptr() + 40)
    assert torch.equal(torch.cat([saved.sharded["param_state"][i]["exp_avg"].data for i in (0, 1)]), torch.arange(10.0))
    # a load asks for the format the checkpoint holds, and Megatron reads into its own tensors:
    # left as they are
    for saved_format in (DP_SHARDS, GATHERED):
        loading = OptimizerState(optimizer, {}, is_loading=True, saved_format=saved_format)
        assert optimizer.calls[-1] == {"is_loading": True, "metadata": MEGATRON_METADATA[saved_format]}
        assert loading.sharded["param_state"][1]["exp_avg"].data.data_ptr() == optimizer.gathered.data_ptr() + 4 * 4
    assert MEGATRON_METADATA[GATHERED] == {"distrib_optim_sharding_type": "fully_reshardable", MEM_EFFICIENT: True}


class _GatherRecorder:
    """``self`` for Megatron's own DistributedOptimizer methods, recording how its state would be
    gathered (``get_parameter_state_dp_zero``) or taken shard by shard
    (``get_parameter_state_dp_reshardable``) instead of doing it."""

    def __init__(self) -> None:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self.checkpoint_fully_reshardable_formats = DistributedOptimizer.checkpoint_fully_reshardable_formats
        self.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
        self.data_parallel_group_idx, self.distributed_optimizer_instance_id = 0, 0
        self.data_parallel_group = SimpleNamespace(rank=lambda: 0, size=lambda: 2)
        self.gbuf_ranges: list = []
        self.gathers: list[dict] = []
        self.own_shards = 0
        self._methods = {name: getattr(DistributedOptimizer, name) for name in
                         ("sharded_param_state_fully_reshardable", "sharded_param_state_dp_reshardable")}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict) -> None:
        pass

    def sharded_param_state_fully_reshardable(self, model_state, is_loading, metadata):
        return self._methods["sharded_param_state_fully_reshardable"](self, model_state, is_loading, metadata)

    def sharded_param_state_dp_reshardable(self, model_state, is_loading, metadata):
        return self._methods["sharded_param_state_dp_reshardable"](self, model_state, is_loading, metadata)

    def get_parameter_state_dp_zero(self, **kwargs):
        self.gathers.append(kwargs)
        return None  # what a DP rank other than 0 gets back when only DP rank 0 gathers

    def get_parameter_state_dp_reshardable(self):
        self.own_shards += 1
        return {"per_bucket_numel": [], "per_bucket_numel_unpadded": []}


@pytest.mark.parametrize("saved_format", [DP_SHARDS, GATHERED])
@pytest.mark.parametrize("is_loading", [False, True], ids=["save", "load"])
def test_megatron_reads_the_keys_a_save_and_a_load_pass(saved_format, is_loading):
    """Megatron's own DistributedOptimizer code (0.16.1 here; 0.19.2 under
    PYTHONPATH=.megatron-newest) reads the keys passed: the format of a save (each rank's own
    shard) gathers nothing; the gathered format of older checkpoints gathers over gloo onto DP
    rank 0 only, not onto every rank (its default), and its load allocates the state on every rank."""
    import megatron.core
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    ours, default = _GatherRecorder(), _GatherRecorder()
    state = DistributedOptimizer.sharded_state_dict(ours, {}, is_loading=is_loading,
                                                    metadata=dict(MEGATRON_METADATA[saved_format]))
    sharding = MEGATRON_METADATA[saved_format]["distrib_optim_sharding_type"]
    assert state["param_state_sharding_type"] == sharding, megatron.core.__version__
    if saved_format == DP_SHARDS:
        assert ours.gathers == [] and ours.own_shards == 1
        assert sharding not in DistributedOptimizer.checkpoint_fully_reshardable_formats  # keyed per bucket
        return
    DistributedOptimizer.sharded_state_dict(default, {}, is_loading=is_loading,
                                            metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    assert "fully_reshardable" in DistributedOptimizer.checkpoint_fully_reshardable_formats
    if is_loading:
        expected = {"use_gloo_comm": True, "empty_data": True, "return_on_all_ranks": True}
        assert ours.gathers == [expected]
    else:
        assert ours.gathers == [{"use_gloo_comm": True, "empty_data": False, "return_on_all_ranks": False}]
        assert default.gathers == [{"use_gloo_comm": False, "empty_data": False, "return_on_all_ranks": True}]


def _swiglu_factory(key: str, data: torch.Tensor):
    """A factory like Megatron's SwiGLU one: the writer saves two halves (views of ``data``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def build(key, data, replica_id, flattened_range):
        gate, up = torch.chunk(data, 2, dim=0)
        return {"gate": ShardedTensor.from_rank_offsets(f"{key}.gate", gate, replica_id=replica_id),
                "up": ShardedTensor.from_rank_offsets(f"{key}.up", up, replica_id=replica_id)}

    def merge(loaded):
        return torch.cat([loaded["gate"], loaded["up"]])

    return ShardedTensorFactory(key, data, build, merge, 0)


def _gathered_state(gathered: torch.Tensor) -> dict:
    """Two parameters' moments as slices of one gathered tensor, as the fully reshardable format
    hands them over: fc1 [4, 3] behind a SwiGLU factory, fc2 [2, 5]."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {"optimizer": {"param_state": {
        0: {"exp_avg": _swiglu_factory("optimizer.state.exp_avg.fc1", gathered[:12].view(4, 3))},
        1: {"exp_avg": ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.fc2", gathered[12:].view(2, 5))},
    }}}


def _save_through_megatrons_writer(root: str, compact: bool) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from bpo_megatron.megatron import ensure_megatron_cpu_compat

    ensure_megatron_cpu_compat()  # the writer's device synchronisation, on a machine without CUDA
    gathered = torch.arange(22, dtype=torch.float32)
    expected = gathered.clone()
    state = _gathered_state(gathered)
    alive = weakref.ref(gathered)
    del gathered
    copied = compact_host_views(state) if compact else 0
    freed_before_save = alive() is None

    staged: list[torch.Tensor] = []  # the tensors Megatron's writer is about to write
    writer = filesystem_async.FileSystemWriterAsync
    original = writer.prepare_write_data

    def spy(self, plan, planner):
        original(self, plan, planner)
        staged.extend(tensor for _, _, (_, tensors) in self.write_buckets for _, tensor in tensors)

    writer.prepare_write_data = spy
    try:
        dist_checkpointing.save(state, root)
    finally:
        writer.prepare_write_data = original
    ours = {t.data.data_ptr() for t in nested_values(state)}  # factories are built in place by now
    writer_copied = sum(t.numel() * t.element_size() for t in staged if t.data_ptr() not in ours)

    empty = _gathered_state(torch.zeros(22))
    loaded = dist_checkpointing.load(empty, root)["optimizer"]["param_state"]
    back = torch.cat([loaded[0]["exp_avg"].flatten(), loaded[1]["exp_avg"].flatten()])
    return {"copied": copied, "freed_before_save": freed_before_save, "staged": len(staged),
            "writer_copied": writer_copied, "same": torch.equal(back, expected)}


@pytest.mark.parametrize("compact", [True, False], ids=["compacted", "as-gathered"])
def test_megatrons_writer_copies_no_compacted_state_and_the_checkpoint_is_the_same(compact, tmp_path):
    [got] = run_gloo_world(_save_through_megatrons_writer, 1, str(tmp_path), compact, timeout=120)
    assert got["same"], got
    assert got["staged"] == 3, got  # fc1's two halves and fc2
    if compact:
        # 22 fp32 values copied out once, the gathered tensor freed before the writer runs, and
        # the writer writes our copies as they are
        assert got["copied"] == 22 * 4 and got["freed_before_save"] and got["writer_copied"] == 0, got
    else:
        # as Megatron hands it over, the writer copies every slice while the gathered tensor lives:
        # the state twice in host memory
        assert not got["freed_before_save"] and got["writer_copied"] == 22 * 4, got
