"""The optimizer's state in a checkpoint, in the format each kind of optimizer saves (:data:`FORMATS`).

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

The distributed optimizer (the GPU path; on CPUs with ``optimizer.distributed: true``) is saved
by every data-parallel rank, each writing its own shard and nothing else: Megatron's
``dp_reshardable`` format, one tensor per gradient bucket of each model-parallel rank, every DP
rank's shard a slice of it at the rank's own index range. No rank gathers anything, so the host
memory of a save is the rank's own shard (on a GPU the writer stages exactly that from the
device; on a CPU the moments are saved as they are and the fp32 master weights, views into the
model's parameter buffer, are copied out once), plus the alignment gaps between its parameters.
A load at another data-parallel size reads, on each rank, its new range of the same bucket
tensors. The buckets are those of the model-parallel
rank, so the format reshards across data parallelism only: a resume under another TP, PP, EP or
expert-TP is refused by name (:func:`check_readable`); the per-parameter format of the fp32
optimizer below reshards across everything. Checkpoints written before this format hold
Megatron's ``fully_reshardable`` one (gathered on DP rank 0 at save, recorded as ``megatron``);
they still load, under any layout. The mixed-precision optimizer without sharding keeps
Megatron's own per-parameter format (``megatron`` too). Formats and what reads them:
:data:`FORMATS`. The arithmetic of what a node holds at a save is :mod:`bpo_megatron.planner.host`'s.

Earlier saves gathered the sharded state (``fully_reshardable``) and left per-parameter slices
of the gathered tensors, which Megatron's writer copies whole before writing, all of them while the
gathered tensors live; :func:`compact_host_views` copies such slices out one tensor at a time,
freeing each as soon as it is copied (for the shards saved now it copies only the CPU path's
master-weight views, once, as the writer would).
"""

from __future__ import annotations

from typing import Any

import torch

from bpo_megatron.trainer.optimizer import fuse_torch_adam

MOMENTS = ("exp_avg", "exp_avg_sq")

# The formats of a checkpoint's optimizer state, as its trainer state records them (``optimizer_format``).
PER_PARAMETER = "per-parameter"  # fp32 optimizers: moments named after their parameters
DP_SHARDS = "megatron-dp-shards"  # distributed optimizer: each DP rank's own shard of each bucket
# Megatron's fully reshardable format: older saves of the distributed optimizer (gathered on DP rank 0),
# and the unsharded mixed-precision optimizer's saves
GATHERED = "megatron"

# What Megatron's optimizers are asked for, by format (``sharded_state_dict(metadata=...)``).
# Megatron 0.16's default (``fully_sharded_model_space``) is deprecated and refused by its own
# checkpoint mapping ("ShardedTensor.flattened_range is not supported", seen on an H100).
MEGATRON_METADATA = {
    DP_SHARDS: {"distrib_optim_sharding_type": "dp_reshardable"},
    GATHERED: {"distrib_optim_sharding_type": "fully_reshardable",
               "distrib_optim_fully_reshardable_mem_efficient": True},
}

# The format an optimizer saves in -> the formats it reads.
FORMATS = {
    PER_PARAMETER: (PER_PARAMETER,),
    DP_SHARDS: (DP_SHARDS, GATHERED),
    GATHERED: (GATHERED,),
}

# The layout entries a DP_SHARDS checkpoint must be resumed under (its buckets are a model-parallel rank's).
MODEL_PARALLEL = ("tp", "pp", "ep", "etp")


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


def save_format(optimizer) -> str:
    """The format ``optimizer`` saves its state in (one of :data:`FORMATS`)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if per_parameter(optimizer):
        return PER_PARAMETER
    if any(isinstance(inner, DistributedOptimizer) for inner in inner_optimizers(optimizer)):
        return DP_SHARDS
    return GATHERED


def check_readable(directory, saved: str, saved_layout: dict, optimizer, layout: dict) -> None:
    """Refuse, by name and with the way out, a checkpoint whose optimizer state (format ``saved``,
    written under ``saved_layout``) ``optimizer`` under ``layout`` cannot read."""
    current = save_format(optimizer)
    if saved not in FORMATS[current]:
        hint = {PER_PARAMETER: "the fp32 optimizer (the CPU path, optimizer.distributed unset or false)",
                DP_SHARDS: "the distributed optimizer (the GPU path, or optimizer.distributed: true)",
                GATHERED: "Megatron's optimizers of the GPU path"}[saved]
        raise ValueError(f"{directory} holds {saved} optimizer state, which this {current} optimizer does not read; "
                         f"it loads into {hint}. Or load it without the optimizer state (load_optimizer=False) to "
                         "continue from its weights")
    refusal = model_parallel_change(directory, saved, saved_layout, layout)
    if refusal:
        raise ValueError(refusal)


def model_parallel_change(directory, saved: str, saved_layout: dict, layout: dict) -> str | None:
    """Why optimizer state of format ``saved`` written under ``saved_layout`` cannot be resumed
    under ``layout`` (the model-parallel entries of :func:`~bpo_megatron.parallel.layout_record`),
    or None. Only :data:`DP_SHARDS` is tied to them."""
    if saved != DP_SHARDS:
        return None
    changed = {key: (saved_layout.get(key), layout.get(key)) for key in MODEL_PARALLEL
               if saved_layout.get(key) != layout.get(key)}
    if not changed:
        return None
    was = ", ".join(f"parallel.{key}={old}" for key, (old, _) in changed.items())
    now = ", ".join(f"parallel.{key}={new}" for key, (_, new) in changed.items())
    return (f"{directory} holds the distributed optimizer's state as each data-parallel rank's shard of its "
            f"model-parallel rank's buckets, which reshards across data parallelism only: it was saved with {was} and "
            f"this run has {now}. Resume with {was} (any data-parallel size); or continue from its weights alone "
            "under the new layout: load it without the optimizer state (TrainActor.load(load_optimizer=False)), or "
            "export them (bpo-megatron convert mcore-to-hf) and start a run from them")


class OptimizerState:
    """The sharded state dict of ``optimizer`` against ``model_state`` (the model's sharded
    state dict), for saving, or for loading followed by :meth:`restore`."""

    def __init__(self, optimizer, model_state: dict, *, is_loading: bool, saved_format: str | None = None) -> None:
        """``saved_format``: at a load, the format the checkpoint holds (one this optimizer reads,
        :data:`FORMATS`); a save writes :func:`save_format`'s."""
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                make_sharded_optimizer_tensor)

        self.optimizer = optimizer
        self.format = save_format(optimizer) if saved_format is None else saved_format
        self.per_parameter = self.format == PER_PARAMETER
        self._targets: dict[str, torch.Tensor] = {}
        self._params: list[dict] = []
        if not self.per_parameter:
            if is_loading:
                _init_empty_distributed_state(optimizer)
            self.sharded = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                        metadata=dict(MEGATRON_METADATA[self.format]))
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


# Megatron's loader of each sharded parameter-state format this module saves or reads.
_PARAMETER_STATE_LOADERS = {
    "fully_reshardable": "load_parameter_state_from_fully_reshardable",
    "dp_reshardable": "load_parameter_state_from_dp_reshardable",
}


def _restore_megatron_format(optimizer, loaded: dict) -> None:
    """``optimizer.load_state_dict(loaded)``, except that the parameter state of the distributed
    optimizer is loaded with torch's per-parameter Adam ``step`` set aside.

    Without transformer-engine or apex, Megatron 0.16 falls back to ``torch.optim.AdamW``, whose
    state holds a ``step`` per parameter. ``load_state_dict`` sets it from the saved param groups;
    then the fully reshardable loader copies every state key of the destination from the
    checkpoint, which has no ``step`` (it skips it on purpose): ``KeyError: 'step'`` (seen on an
    H100); and the DP-reshardable loader copies the ``step`` it was handed when the state dict to
    load into was built (this optimizer's own before the load), undoing the saved one. Loading the
    parameter state while ``step`` is set aside, then putting it back, is the load without either.
    """
    parts = inner_optimizers(optimizer)
    states = [loaded] if len(parts) == 1 else [state for _, state in sorted(loaded.items())]
    for part, state in zip(parts, states):
        loader = _PARAMETER_STATE_LOADERS.get(state.get("param_state_sharding_type"))
        param_state = state.pop("param_state") if loader else None
        part.load_state_dict(state)
        if param_state is None:
            continue
        steps = {param: entry.pop("step") for param, entry in part.optimizer.state.items() if "step" in entry}
        try:
            # no autograd: on a CPU in fp32 the main params are views of the model's (leaf) params
            with torch.no_grad():
                getattr(part, loader)(param_state)
        finally:
            for param, step in steps.items():
                part.optimizer.state[param]["step"] = step


def _init_empty_distributed_state(optimizer) -> None:
    """Give each inner distributed optimizer that has not stepped yet a state to load into: zero
    moments and a zero ``step`` per parameter where torch's Adam keeps one (Megatron's
    ``state_dict()``, which a load starts from, reads the step count from there)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in inner_optimizers(optimizer):
        if not isinstance(inner, DistributedOptimizer) or len(inner.optimizer.state) or inner.init_state_fn is None:
            continue
        inner.init_state_fn(inner.optimizer, inner.config)
        if type(inner.optimizer) in (torch.optim.Adam, torch.optim.AdamW):
            for group in inner.optimizer.param_groups:
                for param in group["params"]:
                    inner.optimizer.state[param]["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
