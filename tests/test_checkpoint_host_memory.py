"""A checkpoint save stays within a node's host memory (the GPU path's distributed optimizer).

The distributed optimizer runs only on GPUs, so this checks the boundary with Megatron on CPU:
the save asks Megatron for its fully reshardable format gathered on DP rank 0 alone, Megatron
(the pinned version, and the newest with ``PYTHONPATH=.megatron-newest``) branches on exactly those
keys, and the gathered state reaches Megatron's writer compact, so the writer copies none of it
while the checkpoint's contents stay the same. The host-memory arithmetic is in test_planner.py;
the offload buffers dropped before a save in test_trainer_offload.py.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch

from bpo_megatron.parallel.local_world import run_gloo_world
from bpo_megatron.trainer.optimizer_state import (DISTRIBUTED_OPTIMIZER_METADATA, OptimizerState,
                                                  compact_host_views)

MEM_EFFICIENT = "distrib_optim_fully_reshardable_mem_efficient"


class _RecordingDistributedOptimizer:
    """Stands in for Megatron's ChainedOptimizer over distributed optimizers (not FP32Optimizer,
    so the state goes through Megatron's own format): records what the save asks it for and
    returns gathered state as Megatron's fully reshardable format does, per-parameter slices of
    one host tensor."""

    def __init__(self) -> None:
        self.chained_optimizers = [self]
        self.calls: list[dict] = []
        self.gathered = torch.arange(10.0)

    def sharded_state_dict(self, model_state, is_loading=False, metadata=None):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        self.calls.append({"is_loading": is_loading, "metadata": metadata})
        first, second = self.gathered[:4], self.gathered[4:]
        return {"param_state": {0: {"exp_avg": ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.a", first)},
                                1: {"exp_avg": ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.b", second)}},
                "param_state_sharding_type": (metadata or {}).get("distrib_optim_sharding_type")}


def test_the_save_asks_megatron_for_its_fully_reshardable_format_gathered_on_dp_rank_0():
    optimizer = _RecordingDistributedOptimizer()
    saved = OptimizerState(optimizer, {}, is_loading=False)
    assert optimizer.calls == [{"is_loading": False, "metadata": {"distrib_optim_sharding_type": "fully_reshardable",
                                                                  MEM_EFFICIENT: True}}]
    # what is saved is compact: no tensor is a slice of the gathered one any more
    for entry in saved.sharded["param_state"].values():
        data = entry["exp_avg"].data
        assert data.untyped_storage().nbytes() == data.numel() * 4
        assert not (optimizer.gathered.data_ptr() <= data.data_ptr() < optimizer.gathered.data_ptr() + 40)
    assert torch.equal(torch.cat([saved.sharded["param_state"][i]["exp_avg"].data for i in (0, 1)]), torch.arange(10.0))
    # a load asks for the same format, and Megatron reads into its own tensors: left as they are
    loading = OptimizerState(optimizer, {}, is_loading=True)
    assert optimizer.calls[-1] == {"is_loading": True, "metadata": DISTRIBUTED_OPTIMIZER_METADATA}
    assert loading.sharded["param_state"][1]["exp_avg"].data.data_ptr() == optimizer.gathered.data_ptr() + 4 * 4


class _GatherRecorder:
    """``self`` for Megatron's own DistributedOptimizer methods, recording how its state would be
    gathered (``get_parameter_state_dp_zero``) instead of gathering it."""

    def __init__(self) -> None:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self.checkpoint_fully_reshardable_formats = DistributedOptimizer.checkpoint_fully_reshardable_formats
        self.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
        self.gathers: list[dict] = []
        self._method = DistributedOptimizer.sharded_param_state_fully_reshardable

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict) -> None:
        pass

    def sharded_param_state_fully_reshardable(self, model_state, is_loading, metadata):
        return self._method(self, model_state, is_loading, metadata)

    def get_parameter_state_dp_zero(self, **kwargs):
        self.gathers.append(kwargs)
        return None  # what a DP rank other than 0 gets back when only DP rank 0 gathers


@pytest.mark.parametrize("is_loading", [False, True], ids=["save", "load"])
def test_megatron_gathers_on_dp_rank_0_alone_over_gloo_with_these_settings(is_loading):
    """Megatron's own DistributedOptimizer code (0.16.1 here; 0.19.2 under
    PYTHONPATH=.megatron-newest) reads the keys the save passes: a save gathers over gloo onto DP
    rank 0 only, not onto every rank (its default); a load allocates the state on every rank."""
    import megatron.core
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    ours, default = _GatherRecorder(), _GatherRecorder()
    state = DistributedOptimizer.sharded_state_dict(ours, {}, is_loading=is_loading,
                                                    metadata=dict(DISTRIBUTED_OPTIMIZER_METADATA))
    DistributedOptimizer.sharded_state_dict(default, {}, is_loading=is_loading,
                                            metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    assert state["param_state_sharding_type"] == "fully_reshardable", megatron.core.__version__
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
