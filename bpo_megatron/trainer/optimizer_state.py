"""The optimizer's state in a checkpoint: per parameter, whatever the layout.

Megatron-Core's ``ChainedOptimizer`` holds one inner optimizer per parameter kind, and the kinds
depend on the layout: with expert parallelism the expert weights get their own optimizer (and
grad-norm group), without it they share the dense one. Its own sharded state dict is keyed by
inner optimizer and by position within it (``chained_1.…`` and parameter indices), so a
checkpoint written at EP=2 has no entry an EP=1 optimizer asks for (a ``KeyError`` on load).

For the fp32 optimizer (the CPU path) this module instead names every moment after the
parameter it belongs to (``optimizer.state.exp_avg.<the parameter's checkpoint key>``), with the
parameter's own sharding, and keeps one step count. Any layout then loads it: each rank asks for
the slices of the parameters it holds. Hyper-parameters are not part of the state: they come from
the run's config (a resumed run with ``--override-resume optimizer.lr`` gets the new rate).

The mixed-precision and distributed optimizers of the GPU path keep Megatron's own format; it
reshards across TP, PP and DP, and across EP as long as expert parallelism stays on or stays
off (the number of inner optimizers is recorded and a change is refused by name).

Host memory of a save (the distributed optimizer). Megatron's ``fully_reshardable`` format
rebuilds, for each parameter, its fp32 master weight and moments whole (not sharded over data
parallelism): it gathers every DP rank's shard into host tensors of the whole model shard,
12 bytes per parameter. By default every DP rank gathers (an NCCL all-gather) and holds all of
it; with ``distrib_optim_fully_reshardable_mem_efficient`` (megatron-core 0.16 through 0.19) only
DP rank 0 of each inner optimizer gathers (over gloo) and writes, the other ranks only send their
shards. Both write the same checkpoint contents and either loads the other's. ``dp_reshardable``
(each rank writes its own shard, no gather) would need far less, but its tensors follow the
optimizer's internal buckets and reshard only across DP, not TP or PP. The gathered state is
per-parameter slices of the gathered tensors, which Megatron's writer copies whole before writing
(``FileSystemWriterAsync`` clones a CPU tensor whose storage is larger than itself): that would
hold the state twice. :func:`compact_host_views` copies the slices out one gathered tensor at a
time, freeing each as soon as it is copied, so the state is held once. The arithmetic of what a
node then holds is :mod:`bpo_megatron.planner.host`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from bpo_megatron.trainer.optimizer import fuse_torch_adam

MOMENTS = ("exp_avg", "exp_avg_sq")

# What Megatron's distributed optimizer is asked for (its ``sharded_state_dict(metadata=...)``):
# the per-parameter format that reshards across TP/PP/DP, gathered on DP rank 0 alone. The
# default (``fully_sharded_model_space``) is deprecated and refused by Megatron 0.16's own
# checkpoint mapping ("ShardedTensor.flattened_range is not supported", seen on an H100).
DISTRIBUTED_OPTIMIZER_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
}


def inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def has_state(optimizer) -> bool:
    """Whether the optimizer has taken a step (a fresh one has no Adam moments to save)."""
    return any(len(inner.optimizer.state) for inner in inner_optimizers(optimizer))


def per_parameter(optimizer) -> bool:
    """Whether the state can be stored per parameter: fp32 optimizers whose state is keyed by
    the model's own parameters (not by sharded fp32 master copies)."""
    from megatron.core.optimizer.optimizer import FP32Optimizer

    return all(isinstance(inner, FP32Optimizer) for inner in inner_optimizers(optimizer))


class OptimizerState:
    """The sharded state dict of ``optimizer`` against ``model_state`` (the model's sharded
    state dict), for saving, or for loading followed by :meth:`restore`."""

    def __init__(self, optimizer, model_state: dict, *, is_loading: bool) -> None:
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                make_sharded_optimizer_tensor)

        self.optimizer = optimizer
        self.per_parameter = per_parameter(optimizer)
        self._targets: dict[str, torch.Tensor] = {}
        self._params: list[dict] = []
        if not self.per_parameter:
            self.sharded = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                        metadata=dict(DISTRIBUTED_OPTIMIZER_METADATA))
            if not is_loading:  # at load Megatron reads into these tensors: they stay as they are
                compact_host_views(self.sharded)
            return
        tensors = {}
        step: Any = 0
        for inner in inner_optimizers(optimizer):
            if is_loading:
                inner.init_state_fn(inner.optimizer, inner.config)  # zero moments to load into
            params = list(inner.get_parameters())
            sharded_params = get_param_id_to_sharded_param_map(model_state, params)
            for index, param in enumerate(params):
                state = inner.optimizer.state[param]
                self._params.append(state)
                step = state.get("step", step)
                for moment in MOMENTS:
                    # The checkpoint key (and the slice of it) is the parameter's; the entry's name
                    # here is only local: a rank holding several experts has several slices of
                    # one expert key.
                    entry = str(len(tensors))
                    tensors[entry] = make_sharded_optimizer_tensor(sharded_params[index], state[moment],
                                                                   prefix=f"optimizer.state.{moment}")
                    self._targets[entry] = state[moment]
        # Adam's step is the same for every parameter (one update moves them all)
        self.sharded = {"moments": tensors, "step": step}

    def restore(self, loaded: dict) -> None:
        """Put what ``dist_checkpointing.load`` returned for :attr:`sharded` into the optimizer,
        its step counters where and as the fused Adam keeps them (:func:`fuse_torch_adam`)."""
        if not self.per_parameter:
            _restore_megatron_format(self.optimizer, loaded)
        else:
            for key, target in self._targets.items():
                target.copy_(loaded["moments"][key])
            step = loaded["step"]
            for state in self._params:
                state["step"] = step.clone() if isinstance(step, torch.Tensor) else torch.tensor(float(step))
        fuse_torch_adam(self.optimizer)


def compact_host_views(sharded: dict) -> int:
    """Give every host tensor of ``sharded`` (a sharded state dict about to be saved) that is a
    slice of a larger host tensor its own compact copy, one underlying tensor at a time, so each
    is freed as soon as its last slice is copied; returns the bytes copied.

    Megatron's writer would otherwise copy each such slice itself, all of them before writing,
    while the tensors they slice stay alive. Factories (tensors a writer splits further, e.g.
    SwiGLU's two halves) are built first, as ``dist_checkpointing.save`` would, so that their
    halves are compact too. Device tensors are left alone: the writer copies exactly their
    elements to the host.
    """
    from megatron.core.dist_checkpointing.mapping import apply_factories

    apply_factories(sharded)
    slices = _host_slices(sharded)
    copied = 0
    for key in list(slices):
        for item in slices.pop(key):
            item.data = item.data.clone()
            copied += item.data.numel() * item.data.element_size()
    return copied


def _host_slices(sharded: dict) -> dict[int, list]:
    """The sharded tensors whose data is a slice of a larger host tensor, by that tensor's memory
    (a function of its own, so that no local variable outlives it holding one)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    slices: dict[int, list] = {}
    for item in nested_values(sharded):
        data = item.data if isinstance(item, ShardedTensor) else None
        if data is None or data.device.type != "cpu":
            continue
        storage = data.untyped_storage()
        if storage.nbytes() != data.numel() * data.element_size():
            slices.setdefault(storage.data_ptr(), []).append(item)
    return slices


def _restore_megatron_format(optimizer, loaded: dict) -> None:
    """``optimizer.load_state_dict(loaded)``, except that the parameter state of the distributed
    optimizer is loaded with torch's per-parameter Adam ``step`` set aside.

    Without transformer-engine or apex, Megatron 0.16 falls back to ``torch.optim.AdamW``, whose
    state holds a ``step`` per parameter. ``load_state_dict`` sets it from the saved param groups,
    then the fully reshardable loader copies every state key of the destination from the
    checkpoint, which has no ``step`` (it skips it on purpose): ``KeyError: 'step'`` (seen on an
    H100). Loading the parameter state while ``step`` is set aside, then putting it back, is the
    same load without the error.
    """
    parts = inner_optimizers(optimizer)
    states = [loaded] if len(parts) == 1 else [state for _, state in sorted(loaded.items())]
    for part, state in zip(parts, states):
        param_state = None
        if state.get("param_state_sharding_type") == "fully_reshardable":
            param_state = state.pop("param_state")
        part.load_state_dict(state)
        if param_state is None:
            continue
        steps = {param: entry.pop("step") for param, entry in part.optimizer.state.items() if "step" in entry}
        try:
            part.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for param, step in steps.items():
                part.optimizer.state[param]["step"] = step
