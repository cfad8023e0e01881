"""A tiny Megatron-Core MoE GPT for CPU tests: config, build, batch, loss and checkpoint helpers.

Every function here runs inside a gloo rank (see ``bpo_megatron.parallel.local_world``). The model is
small enough that one forward/backward takes milliseconds, yet it exercises attention with RoPE,
MoE routing and dispatch, vocab-parallel embedding/output and every parallel layout we test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bpo_megatron.megatron import ensure_megatron_cpu_compat
from bpo_megatron.testing import MODEL_CONFIGS

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

# The sizes are the tests' one tiny MoE (bpo_megatron/testing/configs/tiny_qwen3_moe), built here as a plain
# Megatron GPT (local spec, Megatron's own defaults) to test the CPU compat layer on its own.
_TINY = json.loads((MODEL_CONFIGS / "tiny_qwen3_moe" / "config.json").read_text())
VOCAB_SIZE = _TINY["vocab_size"]
NUM_LAYERS = _TINY["num_hidden_layers"]
HIDDEN_SIZE = _TINY["hidden_size"]
NUM_HEADS = _TINY["num_attention_heads"]
NUM_EXPERTS = _TINY["num_experts"]
TOPK = _TINY["num_experts_per_tok"]
SEQ_LENGTH = 32
MICRO_BATCH_SIZE = 2
SEED = 1234


@dataclass(frozen=True)
class Layout:
    """How the tiny model is split over the ranks of the current world."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dispatcher: str = "alltoall"

    @property
    def sequence_parallel(self) -> bool:
        # Megatron-Core requires sequence parallelism for MoE with TP > 1.
        return self.tp > 1


def init_parallel(layout: Layout) -> None:
    """Initialise Megatron's process groups and its RNG tracker for ``layout``."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ensure_megatron_cpu_compat()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
    )
    model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)


def tracked_rng_draws(count: int = 4) -> dict[str, torch.Tensor]:
    """``count`` uniform draws from each of Megatron's tracked RNG streams, by stream name.

    Forking must leave the default generator where it was; this raises if it does not.
    """
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    default_state = torch.get_rng_state()
    draws = {}
    for name in tracker.get_states():
        with tracker.fork(name):
            draws[name] = torch.rand(count)
    if not torch.equal(torch.get_rng_state(), default_state):
        raise AssertionError("forking a tracked RNG stream changed the default generator")
    return draws


def tiny_config(layout: Layout, *, routing_replay: bool = False) -> TransformerConfig:
    """fp32, dropout-free, fusion-free config: results must not depend on the layout."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN_SIZE,
        num_attention_heads=NUM_HEADS,
        ffn_hidden_size=_TINY["intermediate_size"],
        kv_channels=_TINY["head_dim"],
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=_TINY["moe_intermediate_size"],
        moe_token_dispatcher_type=layout.dispatcher,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01,
        moe_enable_routing_replay=routing_replay,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        sequence_parallel=layout.sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        fp16=False,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        moe_router_fusion=False,
        moe_permute_fusion=False,
    )


def build_tiny_gpt(layout: Layout, *, routing_replay: bool = False) -> GPTModel:
    """Build this rank's part of the tiny MoE GPT (call :func:`init_parallel` first)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.router_replay import RouterReplay

    # Routers register themselves in a class-level list; start from an empty one.
    RouterReplay.clear_global_router_replay_instances()
    return GPTModel(
        config=tiny_config(layout, routing_replay=routing_replay),
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=NUM_EXPERTS, moe_grouped_gemm=False
        ),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        position_embedding_type="rope",
    )


@dataclass
class Batch:
    """One micro-batch of token ids, next-token labels and positions."""

    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]
    position_ids: torch.Tensor  # [b, s]


def make_batch(seed: int = 0) -> Batch:
    """The same random batch on every rank (each rank of a TP/EP group sees the full batch)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LENGTH), generator=gen)
    labels = torch.randint(0, VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LENGTH), generator=gen)
    position_ids = torch.arange(SEQ_LENGTH).unsqueeze(0).expand(MICRO_BATCH_SIZE, -1)
    return Batch(tokens, labels, position_ids)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log p(label) per token from vocab-parallel logits ``[b, s, V/TP]``; returns ``[b, s]``."""
    from megatron.core import tensor_parallel

    # vocab_parallel_cross_entropy works on [s, b, V/TP] and modifies its input in place.
    per_token = tensor_parallel.vocab_parallel_cross_entropy(
        logits.transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous()
    )
    return per_token.transpose(0, 1)


def forward_losses(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Per-token losses ``[b, s]`` of one forward pass (no PP)."""
    logits = model(batch.tokens, batch.position_ids, attention_mask=None)
    return token_losses(logits, batch.labels)


def allreduce_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """Sum the partial grads of sequence-parallel params (norms, routers) over the TP group.

    Under sequence parallelism each TP rank sees only its sequence shard, so these replicated
    params get partial gradients; Megatron's finalize_model_grads does the same all-reduce.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())


def grad_norm(model: torch.nn.Module) -> float:
    """L2 norm of the gradient of the whole (unsharded) model, for a world without DP or EP.

    Each TP-sharded param contributes its shard; a param replicated over TP (norms, router) is
    counted on TP rank 0 only, so nothing is double counted. Call
    :func:`allreduce_sequence_parallel_grads` first.
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    squares = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        if param.grad is not None and param_is_not_tensor_parallel_duplicate(param):
            squares += param.grad.double().pow(2).sum()
    dist.all_reduce(squares)  # every rank of this world holds a distinct part of the model
    return squares.sqrt().item()


def embedding_grad(model: torch.nn.Module) -> torch.Tensor:
    """The full ``[vocab, hidden]`` gradient of the word embedding, gathered over TP shards."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    grad = model.embedding.word_embeddings.weight.grad.contiguous()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size == 1:
        return grad.clone()
    shards = [torch.empty_like(grad) for _ in range(tp_size)]  # the vocab dim is sharded
    dist.all_gather(shards, grad, group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=0)


def save_checkpoint(model: torch.nn.Module, directory: Path) -> None:
    """Write the model as a Megatron distributed checkpoint (layout-independent)."""
    from megatron.core import dist_checkpointing

    directory.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(prefix=""), str(directory))


def load_checkpoint(model: torch.nn.Module, directory: Path) -> None:
    """Load a distributed checkpoint into ``model``, resharding it to the current layout."""
    from megatron.core import dist_checkpointing

    with torch.no_grad():  # any weight the checkpoint did not cover would show up as zeros
        for param in model.parameters():
            param.zero_()
    state = dist_checkpointing.load(model.sharded_state_dict(prefix=""), str(directory))
    model.load_state_dict(state, strict=True)


def mean_loss_forward_step(data_iterator, model):
    """A ``forward_step_func`` for Megatron's schedules: the mean token loss of the next batch."""
    batch = next(data_iterator)
    output = model(batch.tokens, batch.position_ids, attention_mask=None)

    def loss_func(logits: torch.Tensor):
        loss = token_losses(logits, batch.labels).mean()
        # the schedule divides the returned loss in place by num_microbatches; report a copy
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def schedule_logits(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor):
    """One forward-only pass through Megatron's (pipeline) schedule; the last stage returns its
    logits shard, the other stages None."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        next(data_iterator)
        output = model(tokens, positions, attention_mask=None)
        return output, lambda logits: (logits.sum() * 0, {"logits": logits.detach().clone()})

    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
        seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True)
    return reports[0]["logits"] if reports else None
