"""The fused core attention of the local spec (``model.attention: fused``: SDPA for padded batches,
FlashAttention's varlen kernel for packed rows on CUDA, SDPA under a block-diagonal causal mask on
CPU) against Megatron's unfused reference (``unfused``, packed rows one segment at a time): the same
outputs and gradients (fp32, grouped and plain heads, a configured softmax scale) with no host read
in the fused path; one optimizer step of the train actor from the same weights gives the same loss,
grad norm and updated parameters at TP=2 with sequence parallel, EP=2 and PP=2, with R3 replay and
packing on, for two losses in each world; the option's resolution and refusals; packed bounds
checked once where they are built; and, on a GPU, FlashAttention's varlen kernel in bf16."""

from __future__ import annotations

import pytest
import torch

from bpo_megatron import testing as th
from bpo_megatron.parallel.local_world import run_gloo_world

TIMEOUT = 240
RTOL = 1e-6


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest entry of ``want``."""
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------ core attention
def _core_attention_results() -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from bpo_megatron.bench.ops import _count
    from bpo_megatron.models.fused_attention import FusedDotProductAttention
    from bpo_megatron.models.packed_attention import PackedDotProductAttention
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.parallel.state import initialize_parallel

    initialize_parallel(ParallelConfig(), seed=0)
    gen = torch.Generator().manual_seed(0)
    dim = 32
    bounds = [0, 5, 6, 13, 16]  # segments of 5, 1, 7 and 3 positions
    cu = torch.tensor(bounds, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    results = {}
    for heads, groups, scale in ((4, 2, None), (4, 4, 0.37)):
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, num_query_groups=groups,
                                   kv_channels=dim, use_cpu_initialization=True, attention_dropout=0.0)
        modules = {cls: cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                            softmax_scale=scale) for cls in (FusedDotProductAttention, PackedDotProductAttention)}
        cases = {  # name -> (query, key, value, packed parameters)
            "padded": (torch.randn(9, 2, heads, dim, generator=gen), torch.randn(9, 2, groups, dim, generator=gen),
                       torch.randn(9, 2, groups, dim, generator=gen), None),
            "packed": (torch.randn(16, heads, dim, generator=gen), torch.randn(16, groups, dim, generator=gen),
                       torch.randn(16, groups, dim, generator=gen), params),
        }
        for case, (*tensors, packed) in cases.items():
            # the output: [s, b, heads × d] padded, [t, 1, heads × d] packed
            rows = (tensors[0].shape[0], 1) if packed is not None else tensors[0].shape[:2]
            upstream = torch.randn(*rows, heads * dim, generator=gen)
            got = {}
            for cls, module in modules.items():
                inputs = [t.clone().requires_grad_() for t in tensors]
                out = {}

                def run(module=module, inputs=inputs, packed=packed, out=out):
                    out["out"] = module(*inputs, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=packed)
                    out["out"].backward(upstream)

                counts = _count(run)
                got[cls.__name__] = {"out": out["out"].detach(), "grads": [t.grad for t in inputs], "counts": counts}
            results[(heads, groups, scale, case)] = got
    return results


def test_fused_core_attention_equals_the_unfused_reference():
    """Padded [s, b, heads, d] and packed [t, heads, d] rows, grouped (4 heads, 2 groups) and plain
    heads with a configured softmax scale: outputs and the gradients of query, key and value within
    1e-6 of the largest entry; the fused path reads nothing on the host, the reference reads the
    bounds of a packed row."""
    (results,) = run_gloo_world(_core_attention_results, 1, timeout=TIMEOUT)
    assert len(results) == 4
    for (heads, groups, scale, case), got in results.items():
        where = (heads, groups, scale, case)
        fused, reference = got["FusedDotProductAttention"], got["PackedDotProductAttention"]
        assert fused["out"].shape == reference["out"].shape, where
        width = heads * 32
        assert reference["out"].shape == ((16, 1, width) if case == "packed" else (9, 2, width)), where
        assert _rel(fused["out"], reference["out"]) <= RTOL, where
        for name, a, b in zip("qkv", fused["grads"], reference["grads"]):
            assert a.shape == b.shape and _rel(a, b) <= RTOL, (where, name, _rel(a, b))
        syncs = {k: fused["counts"][k] for k in ("scalar_reads", "data_shaped", "tolist_cpu")}
        assert syncs == {"scalar_reads": 0, "data_shaped": 0, "tolist_cpu": 0}, (where, syncs)
        assert fused["counts"]["mm"] == 0, where  # no score matrix by matmul: SDPA's kernel
        if case == "packed":
            assert reference["counts"]["tolist_cpu"] >= 1, where


def test_the_block_causal_mask_aligns_segments_of_unequal_lengths_at_their_ends():
    """The CPU stand-in of the varlen kernel takes its interface: query and key bounds, causal from
    the segment's end where a segment has fewer queries than keys (FlashAttention's alignment)."""
    from bpo_megatron.models.varlen_attention import _block_causal_mask

    cu_q, cu_kv = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 3, 5], dtype=torch.int32)
    want = torch.tensor([[1, 1, 0, 0, 0],   # segment 0: 2 queries over 3 keys
                         [1, 1, 1, 0, 0],
                         [0, 0, 0, 1, 1]],  # segment 1: 1 query, the last, sees both keys
                        dtype=torch.bool)
    assert torch.equal(_block_causal_mask(cu_q, 3, cu_kv, 5), want)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    square = torch.zeros(4, 4, dtype=torch.bool)
    square[:3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    square[3, 3] = True
    assert torch.equal(_block_causal_mask(cu, 4, cu, 4), square)


# ------------------------------------------------------------------------------ the option
def test_auto_is_fused_on_gpus_and_unfused_on_cpu_and_unknown_names_are_refused():
    from bpo_megatron.models import ModelOptions
    from bpo_megatron.models.options import local_core_attention

    assert local_core_attention("auto", gpu=True) == "fused"
    assert local_core_attention("auto", gpu=False) == "unfused"
    assert local_core_attention("unfused", gpu=True) == "unfused"
    assert local_core_attention("fused", gpu=False) == "fused"
    assert ModelOptions().attention == "auto"
    resolved = ModelOptions(params_dtype="fp32").resolved()
    assert resolved.attention == ("fused" if torch.cuda.is_available() else "unfused")
    assert resolved.resolved() is resolved
    with pytest.raises(ValueError, match="model.attention='flash'"):
        ModelOptions(attention="flash")


def _specs_and_refusals() -> dict:
    from dataclasses import replace

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType

    from bpo_megatron.models import ModelOptions
    from bpo_megatron.models.fused_attention import FusedDotProductAttention
    from bpo_megatron.models.megatron_model import layer_spec, transformer_config

    ps.initialize_model_parallel()
    try:
        hf = th.tiny_moe()
        config = transformer_config(hf, _parallel(), ModelOptions(params_dtype="fp32"))
        built = {choice: {layer.submodules.self_attention.submodules.core_attention.__name__
                          for layer in layer_spec(hf, config, attention=choice).layer_specs}
                 for choice in ("auto", "fused", "unfused")}
        refused = []
        for change in ({"attention_dropout": 0.1}, {"window_size": (4, 0)}, {"apply_query_key_layer_scaling": True}):
            try:
                FusedDotProductAttention(replace(config, **change), layer_number=1,
                                         attn_mask_type=AttnMaskType.causal, attention_type="self")
                refused.append("built")
            except ValueError as exc:
                refused.append(str(exc))
        module = FusedDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                          attention_type="self")
        q = torch.zeros(3, 1, hf.num_attention_heads, hf.head_dim)
        kv = torch.zeros(3, 1, hf.num_key_value_heads, hf.head_dim)
        try:
            module(q, kv, kv, torch.ones(1, 1, 3, 3, dtype=torch.bool))
            refused.append("ran")
        except ValueError as exc:
            refused.append(str(exc))
        return {"built": built, "refused": refused}
    finally:
        ps.destroy_model_parallel()


def _parallel():
    from bpo_megatron.parallel import ParallelConfig

    return ParallelConfig()


def test_the_spec_takes_the_chosen_core_attention_and_the_fused_one_refuses_what_it_does_not_compute():
    (got,) = run_gloo_world(_specs_and_refusals, 1, timeout=TIMEOUT)
    assert got["built"] == {"auto": {"FusedDotProductAttention" if torch.cuda.is_available()
                                     else "PackedDotProductAttention"},
                            "fused": {"FusedDotProductAttention"}, "unfused": {"PackedDotProductAttention"}}
    dropout, window, scaling, masked = got["refused"]
    assert "attention dropout" in dropout and "model.attention=unfused" in dropout
    assert "sliding-window" in window
    assert "apply_query_key_layer_scaling" in scaling
    assert "attention_mask" in masked


# ------------------------------------------------------------------------------ packed bounds
def _params(q, kv=None, *, max_seqlen=None, **kwargs):
    from megatron.core.packed_seq_params import PackedSeqParams

    q = torch.tensor(q, dtype=torch.int32) if isinstance(q, list) else q
    kv = q if kv is None else torch.tensor(kv, dtype=torch.int32)
    longest = max_seqlen if max_seqlen is not None else int((q[1:] - q[:-1]).max())
    return PackedSeqParams(**{"qkv_format": "thd", "cu_seqlens_q": q, "cu_seqlens_kv": kv,
                              "max_seqlen_q": longest, "max_seqlen_kv": longest, **kwargs})


@pytest.mark.parametrize("params, match", [
    (lambda: _params([0, 5, 3, 8]), r"rise strictly from 0 to the 8"),
    (lambda: _params([0, 4, 7]), r"rise strictly from 0 to the 8"),
    (lambda: _params([1, 4, 8]), r"rise strictly from 0 to the 8"),
    (lambda: _params([0, 4, 4, 8]), r"rise strictly"),  # an empty segment
    (lambda: _params([0, 4, 8], [0, 3, 8]), r"cu_seqlens_q == cu_seqlens_kv"),
    (lambda: _params([0, 4, 8], [0, 8]), r"cu_seqlens_q == cu_seqlens_kv"),
    (lambda: _params([0, 2, 8], max_seqlen=4), r"max_seqlen_q=4 must be an int of at least the longest segment \(6\)"),
    (lambda: _params(torch.tensor([0, 4, 8])), r"int32"),
    (lambda: _params(torch.tensor([0, 4, 8], dtype=torch.int32, device="meta"), max_seqlen=4),
     r"on the host where they are built"),
    (lambda: _params([0, 4, 8], qkv_format="sbhd"), r"qkv_format='thd'"),
    (lambda: _params([0, 4, 8], cu_seqlens_q_padded=torch.tensor([0, 4, 6], dtype=torch.int32)),
     r"padded segment bounds \(cu_seqlens_\*_padded\) other than the segments themselves"),
])
def test_bad_packed_bounds_are_refused_by_name(params, match):
    from bpo_megatron.models.packed_attention import check_packed_seq_params

    with pytest.raises(ValueError, match=match):
        check_packed_seq_params(params(), total=8)
    check_packed_seq_params(_params([0, 4, 5, 8]), total=8)  # what a pack builds passes


def test_a_pack_checks_its_bounds_once_where_it_builds_them(monkeypatch):
    """The trainer's packing is where the bounds come from host lengths: it checks them there, once
    per micro-batch, on the host tensors it then hands to the model."""
    from bpo_megatron.models import packed_attention
    from bpo_megatron.trainer.packing import pack
    from bpo_megatron.trainer.samples import TrainSample

    calls = []
    real = packed_attention.check_packed_seq_params
    monkeypatch.setattr(packed_attention, "check_packed_seq_params",
                        lambda params, *, total: calls.append((params, total)) or real(params, total=total))

    def sample(tokens):
        tokens = torch.tensor(tokens)
        return TrainSample(tokens=tokens, response_start=1, rollout_logprobs=-torch.ones(tokens.numel() - 1),
                           advantage=1.0)

    micro = pack([sample([1, 2, 3]), sample([4, 5, 6, 7])], pad_to_multiple=4)
    assert micro.cu_seqlens.tolist() == [0, 2, 5, 8] and micro.max_seqlen == 3
    ((params, total),) = calls
    assert total == 8 and params.cu_seqlens_q is micro.cu_seqlens and params.max_seqlen_q == 3
    assert micro.cu_seqlens.device.type == "cpu"


# ------------------------------------------------------------------------------ a training step
def _actor(attention: str, layout: dict, loss: str, max_tokens: int):
    from bpo_megatron.models import ModelOptions
    from bpo_megatron.parallel import ParallelConfig
    from bpo_megatron.trainer.config import TrainerConfig
    from bpo_megatron.trainer.optimizer import OptimizerSettings
    from bpo_megatron.trainer.spec import TrainerSpec

    return TrainerSpec(
        hf=th.tiny_moe(),
        parallel=ParallelConfig(**layout),
        model=ModelOptions(routing_replay=True, params_dtype="fp32", attention=attention),
        loss=loss,
        # Adam's first step moves a weight by lr·g / (|g| + eps): eps = lr keeps that within |g| of
        # the gradient, where the default 1e-8 turns fp32 rounding of gradients near 1e-8 (summed in
        # another order by the fused kernels) into whole fractions of a step
        optimizer=OptimizerSettings(lr=1e-3, eps=1e-3, grad_clip=1.0),
        trainer=TrainerConfig(micro_batch_size=2, max_tokens_per_micro_batch=max_tokens),
    ).build()


def _both_ways(layout: dict, runs: list[tuple[str, int]]) -> dict:
    """On every rank, per (loss, token budget; 0: padded micro-batches): the unfused reference steps
    from fresh weights, the fused attention from the same weights (built with the same seed;
    compared). Metrics and parameters of both."""
    from bpo_megatron.models.fused_attention import FusedDotProductAttention

    samples = th.make_samples(8, seed=1, routing=True)
    results = {}
    for loss, max_tokens in runs:
        got = {}
        actor = _actor("unfused", layout, loss, max_tokens)
        got["initial"] = th.flat_params(actor)
        got["ref_metrics"] = actor.train_step(samples)
        got["ref_params"] = th.flat_params(actor)
        actor.close()

        actor = _actor("fused", layout, loss, max_tokens)
        got["fused_modules"] = sum(isinstance(m, FusedDotProductAttention) for m in actor.model.modules())
        got["fused_initial"] = th.flat_params(actor)
        got["fused_metrics"] = actor.train_step(samples)
        got["fused_params"] = th.flat_params(actor)
        actor.close()
        results[f"{loss} {'packed' if max_tokens else 'padded'}"] = got
    return results


LAYOUTS = {  # name -> (world size, layout)
    "tp2_sp": (2, dict(tp=2)),
    "ep2": (2, dict(ep=2)),
    "pp2": (2, dict(pp=2)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_step_with_fused_attention_equals_the_unfused_reference(name):
    """R3 replay; BPO and GRPO packed (≤ 24 positions a micro-batch: the varlen path) and BPO
    padded (two samples a micro-batch: SDPA's causal kernel), in one world: the same loss, grad norm
    and updated parameters within 1e-6."""
    world, layout = LAYOUTS[name]
    results = run_gloo_world(_both_ways, world, layout, [("bpo", 24), ("grpo", 24), ("bpo", 0)], timeout=TIMEOUT)
    assert len(results) == world
    for rank, per_loss in enumerate(results):
        assert list(per_loss) == ["bpo packed", "grpo packed", "bpo padded"]
        for loss, got in per_loss.items():
            where = f"{name} rank {rank} {loss}"
            assert got["fused_modules"] > 0, where
            assert list(got["fused_params"]) == list(got["ref_params"]) == list(got["initial"]), where
            for key, value in got["initial"].items():
                assert torch.equal(got["fused_initial"][key], value), (where, key)
            for key in ("loss", "grad_norm"):
                a, b = got["fused_metrics"][key], got["ref_metrics"][key]
                # BPO's loss (≈ -0.3) is a difference of terms of order 1: relative to 1 at least
                assert abs(a - b) <= RTOL * max(abs(b), 1.0), (where, key, a, b)
            assert got["fused_metrics"]["num_tokens"] == got["ref_metrics"]["num_tokens"], where
            for key, ref in got["ref_params"].items():
                fused = got["fused_params"][key]
                assert _rel(fused, ref) <= RTOL, (where, key, _rel(fused, ref))
                torch.testing.assert_close(fused, ref, rtol=RTOL, atol=1e-7, msg=f"{where} {key}")


# ------------------------------------------------------------------------------ on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernel needs CUDA")
@pytest.mark.parametrize("heads, groups", [(8, 2), (8, 8)])
def test_flash_varlen_on_cuda_in_bf16_equals_the_reference(heads, groups):
    """bf16 on the GPU (FlashAttention's varlen kernel; torch 2.14 may take cuDNN's for plain
    heads) against the fp32 block-mask path (equal to Megatron's attention on CPUs, above) on the
    same bf16 inputs: outputs and gradients within bf16 rounding. Segments of 1 to 300 positions,
    across FlashAttention's 128-wide blocks."""
    from bpo_megatron.models.varlen_attention import varlen_causal_attention

    gen = torch.Generator().manual_seed(0)
    lengths = [300, 1, 77, 129, 64]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t, dim = int(bounds[-1]), 128
    tensors = [torch.randn(t, n, dim, generator=gen).to(torch.bfloat16) for n in (heads, groups, groups)]
    upstream = torch.randn(t, heads, dim, generator=gen).to(torch.bfloat16)
    outs, grads = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        inputs = [x.cuda().to(dtype).requires_grad_() for x in tensors]
        cu = bounds.cuda()
        out = varlen_causal_attention(*inputs, cu, cu, max(lengths), max(lengths), scale=dim ** -0.5)
        out.backward(upstream.cuda().to(dtype))
        outs[dtype], grads[dtype] = out.float().cpu(), [x.grad.float().cpu() for x in inputs]
    assert outs[torch.bfloat16].shape == (t, heads, dim)
    assert _rel(outs[torch.bfloat16], outs[torch.float32]) <= 1e-2  # SDPA in bf16 on a CPU: 3e-3
    for name, a, b in zip("qkv", grads[torch.bfloat16], grads[torch.float32]):
        assert _rel(a, b) <= 3e-2, (name, _rel(a, b))  # SDPA in bf16 on a CPU: 4e-3 to 8e-3
