"""Supervised warm start on reference answers (CPU demos: a random tiny model knows nothing).

An SFT step is a policy step with advantage +1 on the reference response and the trainer's own
log-probs as μ and π_old, under the GRPO loss whatever ``loss.name`` says: its ratio is then 1,
nothing is clipped, and the update is exactly the negative log-likelihood gradient (aggregated as
``loss.agg``) — no separate loss code path is needed. Not every loss's gradient at μ = π is the
log-likelihood's (BPO's and GSPO's are not), and the methods of a comparison must start from the
same warm start, so the run's own loss takes over only for RL.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from bpo_megatron.trainer.samples import TrainSample


def warm_start_loss(loss):
    """The loss of a warm start: the log-likelihood (GRPO at ratio 1, no correction), aggregated
    as the run's loss is."""
    return replace(loss, name="grpo", correction="none")


def sft_warmup(cfg, trainer, prompts, tokenizer, metrics_out, echo) -> None:
    eos = tokenizer.eos_token_ids[0]
    trainer.call("set_loss", warm_start_loss(cfg.loss))
    if cfg.train.sft_lr is not None:
        trainer.call("set_learning_rate", cfg.train.sft_lr)
    for step in range(1, cfg.train.sft_warmup_steps + 1):
        samples = []
        for encoded in prompts.take(cfg.train.sft_batch_size):
            prompt = list(encoded.prompt_tokens)
            answer = tokenizer.encode(encoded.problem.answer) + [eos]
            samples.append(TrainSample(tokens=torch.tensor(prompt + answer), response_start=len(prompt),
                                       rollout_logprobs=torch.zeros(len(answer)), advantage=1.0))
        # With R3 the trainer replays routing; here it replays its own, recorded in this forward.
        replay = cfg.model.routing_replay
        scored = trainer.compute_logprobs(samples, record_routing=replay)
        routing = scored.routed_experts if replay else [None] * len(samples)
        # μ = π_old = π: every loss weight and mismatch correction is exactly 1
        samples = [replace(s, rollout_logprobs=lp.clamp(max=0.0), old_logprobs=lp.clamp(max=0.0), routed_experts=r)
                   for s, lp, r in zip(samples, scored.logprobs, routing)]
        metrics = trainer.train_step(samples)
        nll = -float(torch.cat(scored.logprobs).mean())
        metrics_out.write(-cfg.train.sft_warmup_steps + step, {"sft/nll": nll, "sft/grad_norm": metrics["grad_norm"]})
        if step == 1 or step % 10 == 0 or step == cfg.train.sft_warmup_steps:
            echo(f"sft {step}/{cfg.train.sft_warmup_steps} | nll {nll:.3f}")
    trainer.call("set_learning_rate", cfg.optimizer.lr)
    trainer.call("set_loss", cfg.loss)
