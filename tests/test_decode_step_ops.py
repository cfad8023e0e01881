"""What one embedded-engine decode step dispatches — the function a CUDA graph captures
(``DecodeState.step``: the forward, the sampler, the bookkeeping) — counted on a CPU: the ATen ops
of the step as it runs on a GPU in bf16 (FlashAttention, the fused QKV, the grouped-GEMM experts,
the fused sampler), traced on ``meta`` tensors, so every op the GPU step would dispatch is seen and
none runs. The model is the kit's throughput model's layer shape (32 experts top-4, 16 query and
4 key-value heads; ``bench/ops.py``'s ``MODEL``) at a small width: ops per layer do not depend on
the width, so the count at the kit's 16 layers is the count of 2 layers plus 14 times the
difference between 3 and 2 layers.

Counted as work: every op that writes memory — not a view, not an op returning its input or a view
of it (``to`` a dtype it has, a ``reshape`` that needs no copy), not an allocation (``empty``). On a
GPU each such op is a kernel (a few launch two: ``topk``, ``cumsum``), so the count moves with the
kernels the replayed graph launches (the kit's ``rollout_decode`` profiles a replay and reports
them). The issue's goal, ≤ 250 kernels a step, needs ``rollout.hf.compile`` on top (elementwise ops
fused between the GEMMs); this budget holds the uncompiled step, which the compiled one starts from.

Inside the captured step nothing may read a value on the host (``aten::_local_scalar_dense``) or
size a tensor by its data (``nonzero``, boolean-mask indexing, …): a graph cannot replay either.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bpo_megatron.bench.ops import MODEL, SYNC_OPS, OpCounter
from bpo_megatron.rollout.hf import fused_qkv
from bpo_megatron.rollout.hf.slots import DecodeState, StateShape

KIT_LAYERS = 16
ROWS, LENGTH = 8, 64
EMPTY = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")
# work ops of the uncompiled bf16 step at the kit's 16 layers: 1,053 (63 a layer, 45 once a step),
# unfiltered or with top-k/top-p; with the argsort dispatch, three QKV GEMMs and the torch sampler
# (commit cdec415) the same count gave 1,255 unfiltered and 1,268 filtered (75 a layer). What is left
# a layer is mostly elementwise: three RMSNorms in transformers' order (8 ops each), RoPE, the
# router's softmax/top-k/normalisation, the counting sort — what rollout.hf.compile fuses
BUDGET = 1060


class WorkCounter(OpCounter):
    """:class:`~bpo_megatron.bench.ops.OpCounter` that also counts, by name, the ops that write
    memory (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.work: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = func.overloadpacket.__name__
        outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage()._cdata for t in _tensors(args, kwargs)}
        aliases = all(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if name in EMPTY or (aliases and all(t.untyped_storage()._cdata in inputs for t in outputs)):
            return out
        self.work[name] += 1
        return out


def _tensors(args, kwargs):
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _step_ops(layers: int, filtered: bool) -> WorkCounter:
    """One bf16 decode step of the GPU path, on meta tensors, counted."""
    config = AutoConfig.for_model(**{**MODEL, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.requires_grad_(False).eval()
    fused_qkv.install(model)  # as the engine does
    shape = StateShape(slots=ROWS, length=LENGTH, routing=True, filtered=filtered, stop_width=4)
    with torch.inference_mode():
        state = DecodeState(model, shape, "flash", cuda_graph=False, fused_sampler=True)
        with WorkCounter() as counter:
            state.step()
    return counter


@pytest.fixture(scope="module", params=[False, True], ids=["unfiltered", "top_k_top_p"])
def counts(request) -> dict:
    two, three = _step_ops(2, request.param), _step_ops(3, request.param)
    per_layer = Counter(three.work)
    per_layer.subtract(two.work)
    at_kit = sum(two.work.values()) + (KIT_LAYERS - 2) * sum(per_layer.values())
    return dict(two=two, three=three, per_layer=+per_layer, at_kit=at_kit)


def test_the_captured_step_reads_nothing_on_the_host_and_sizes_nothing_by_data(counts):
    for counter in (counts["two"], counts["three"]):
        assert sum(counter.ops[name] for name in SYNC_OPS) == 0
        assert counter.data_shaped == 0


def test_the_step_runs_its_layers_as_one_qkv_gemm_grouped_experts_and_flash_attention(counts):
    per_layer = counts["per_layer"]
    assert per_layer["linear"] == 3  # one QKV, the output projection, the router
    assert per_layer["grouped_gemm"] == 2 and per_layer["_flash_attention_forward"] == 1
    assert not {"argsort", "sort", "scatter_add_", "log_softmax", "searchsorted"} & set(per_layer)
    step = counts["two"].work
    assert step["fused_plain_draw"] + step["fused_filtered_draw"] == 1  # the sampler: one kernel
    assert not {"sort", "argsort", "log_softmax", "searchsorted", "nextafter"} & set(step)


def test_the_steps_work_at_the_kits_16_layers_stays_within_its_budget(counts):
    print(f"work ops a step at {KIT_LAYERS} layers: {counts['at_kit']} "
          f"({sum(counts['per_layer'].values())} a layer: {dict(counts['per_layer'])})")
    assert counts["at_kit"] <= BUDGET
