"""Supervised warm start on reference answers (CPU demos: a random tiny model knows nothing).

An SFT step is a policy step with advantage +1 on the reference response and the trainer's own
log-probs as μ and π_old, under the GRPO loss whatever ``loss.name`` says: its ratio is then 1,
nothing is clipped, and the update is exactly the negative log-likelihood gradient (aggregated as
``loss.agg``) — no separate loss code path is needed. Not every loss's gradient at μ = π is the
log-likelihood's (BPO's and GSPO's are not), and the methods of a comparison must start from the
same warm start, so the run's own loss takes over only for RL.

With a ``rollout.agent`` that gives demonstrations (the calculator's: ``[37*58]=2146;2146``), the
warm start imitates the conversation instead of the plain answer: its model turns are trained on,
the environment's tokens between them are in the sequence but out of the loss.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from bpo_megatron.trainer.samples import TrainSample


def warm_start_loss(loss):
    """The loss of a warm start: the log-likelihood (GRPO at ratio 1, no correction, no score
    centering: a reference answer has no sampler), aggregated as the run's loss is."""
    return replace(loss, name="grpo", correction=replace(loss.correction, name="none"), score_centering=False)


def demonstrated(prompt: list[int], problem, tokenizer, agent=None) -> TrainSample:
    """The sequence a warm start trains on: the prompt, then the agent's demonstration of the
    answer (environment tokens out of the loss) or the plain reference answer, then end-of-sequence."""
    turns = agent.demonstration(problem.problem, problem.answer) if agent is not None else None
    pieces = [(problem.answer, False)] if turns is None else [(t.text, t.from_environment) for t in turns]
    tokens, mask = [], []
    for text, from_environment in pieces:
        ids = tokenizer.encode(text)
        tokens += ids
        mask += [not from_environment] * len(ids)
    tokens.append(tokenizer.eos_token_ids[0])
    mask.append(True)
    return TrainSample(tokens=torch.tensor(prompt + tokens), response_start=len(prompt),
                       rollout_logprobs=torch.zeros(len(tokens)), advantage=1.0,
                       train_mask=None if all(mask) else torch.tensor(mask))


def sft_warmup(cfg, trainer, prompts, tokenizer, metrics_out, echo, *, agent=None) -> None:
    trainer.set_loss(warm_start_loss(cfg.loss))
    if cfg.train.sft_lr is not None:
        trainer.set_learning_rate(cfg.train.sft_lr)
    for step in range(1, cfg.train.sft_warmup_steps + 1):
        samples = [demonstrated(list(encoded.prompt_tokens), encoded.problem, tokenizer, agent)
                   for encoded in prompts.take(cfg.train.sft_batch_size)]
        # With R3 the trainer replays routing; here it replays its own, recorded in this forward.
        replay = cfg.model.options.routing_replay
        scored = trainer.compute_logprobs(samples, record_routing=replay)
        routing = scored.routed_experts if replay else [None] * len(samples)
        # μ = π_old = π: every loss weight and mismatch correction is exactly 1
        samples = [replace(s, rollout_logprobs=lp.clamp(max=0.0), old_logprobs=lp.clamp(max=0.0), routed_experts=r)
                   for s, lp, r in zip(samples, scored.logprobs, routing)]
        metrics = trainer.train_step(samples)
        nll = -float(torch.cat([lp if s.train_mask is None else lp[s.train_mask]
                                for s, lp in zip(samples, scored.logprobs)]).mean())
        metrics_out.write(-cfg.train.sft_warmup_steps + step, {"sft/nll": nll, "sft/grad_norm": metrics["grad_norm"]})
        if step == 1 or step % 10 == 0 or step == cfg.train.sft_warmup_steps:
            echo(f"sft {step}/{cfg.train.sft_warmup_steps} | nll {nll:.3f}")
    trainer.set_learning_rate(cfg.optimizer.lr)
    trainer.set_loss(cfg.loss)
