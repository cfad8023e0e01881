"""Budget: what a training step reads back from the device, counted as ``bpo-megatron bench ops``
counts it (``bpo_megatron.bench.ops``), with every fast path on.

No scalar read (``aten::_local_scalar_dense``) and no data-shaped op in a micro-batch; at most
:data:`STEP_READS` scalar reads in a step, whatever the number of parameters: the sample checks
(one read for each check of the batch and of this rank's share, three for the routing ids), the
loss inputs' values (one deferred read before the update) and Megatron's gradient norm (one).
The one ``tolist`` a packed micro-batch keeps is ``pack``'s check of the segment bounds it has
just built on the host (``models.packed_attention.check_packed_seq_params``): no device is waited
for. A step's metrics and the agreed micro-batch count are read in one ``tolist`` each.
"""

from __future__ import annotations

from bpo_megatron.bench.ops import MODEL, _measure
from bpo_megatron.models.options import fast_path_options
from bpo_megatron.parallel.local_world import run_gloo_world

STEP_READS = 10
TINY = {**MODEL, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 1, "num_experts_per_tok": 2,
        "vocab_size": 128}


def test_a_step_reads_the_device_a_few_times_and_a_micro_batch_never():
    counts = {experts: run_gloo_world(_measure, 1, fast_path_options(on=True), {**TINY, "num_experts": experts},
                                      2, 16, timeout=300)[0]
              for experts in (4, 8)}  # 8 experts: 8 more expert parameters
    for experts, got in counts.items():
        per_micro_batch, step = got["micro_batch"], got["step"]
        assert per_micro_batch["scalar_reads"] == 0 and per_micro_batch["data_shaped"] == 0, (experts, got)
        assert per_micro_batch["tolist_cpu"] <= 1, (experts, got)
        assert step["scalar_reads"] <= STEP_READS, (experts, got)
        assert step["tolist_cpu"] - 2 * per_micro_batch["tolist_cpu"] <= 2, (experts, got)
    assert counts[4]["step"]["scalar_reads"] == counts[8]["step"]["scalar_reads"]


def _step_on_nan_logprobs(nan_ranks: tuple[int, ...] = (0,)) -> dict:
    """A train step whose model yields NaN log-probs on the ranks ``nan_ranks`` (their final norm's
    weights NaN); under data parallelism the others' inputs are fine, but the gradient reduction
    hands them the NaN gradients."""
    import torch
    import torch.distributed as dist

    from bpo_megatron import testing as th
    from bpo_megatron.trainer import optimizer_state

    actor = th.build_actor()
    if dist.get_rank() in nan_ranks:
        norm = next(p for name, p in actor.model.named_parameters() if "final_layernorm" in name)
        with torch.no_grad():
            norm.fill_(float("nan"))
    before = th.flat_params(actor)
    try:
        actor.train_step(th.make_samples(4, seed=1))
        error = None
    except ValueError as exc:
        error = str(exc)
    unchanged = all(torch.equal(before[name].nan_to_num(), p.nan_to_num()) for name, p in th.flat_params(actor).items())
    result = {"error": error, "unchanged": unchanged, "step": actor.step,
              "optimizer_state": optimizer_state.has_state(actor.optimizer)}
    actor.close()
    return result


def test_a_step_on_bad_loss_inputs_is_refused_before_the_update():
    """The loss inputs' values are read once, after the micro-batches' backward passes and before
    the optimizer step: a refused step names the input and leaves weights and optimizer untouched."""
    (got,) = run_gloo_world(_step_on_nan_logprobs, 1, timeout=300)
    assert got["error"] is not None and got["error"].startswith("logprobs has ") and "non-finite" in got["error"]
    assert got["unchanged"] and got["step"] == 0 and not got["optimizer_state"]


def test_every_data_parallel_rank_refuses_a_step_one_rank_refuses():
    """The loss inputs' refusal is agreed over the trainer world in the same one read: the rank
    with bad inputs names them, the others say another rank refused, and no rank updates."""
    first, second = run_gloo_world(_step_on_nan_logprobs, 2, (1,), timeout=300)  # DP = 2, rank 1's NaN
    assert second["error"] is not None and second["error"].startswith("logprobs has ")
    assert first["error"] is not None and first["error"].startswith("another trainer rank refused")
    assert all(got["unchanged"] and got["step"] == 0 and not got["optimizer_state"] for got in (first, second))
