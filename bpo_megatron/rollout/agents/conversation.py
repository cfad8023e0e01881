"""Multi-turn rollouts over any engine or engine group: every response is a conversation.

:class:`Conversations` has the ``generate`` / ``submit`` of an engine group, so the loop, the
rollout pipeline and evaluation use it unchanged. The first turn of every response is the
request itself (its ``n`` responses, the agent's call token added to its stop tokens). Each
response whose turn ended with the call token gets the agent's answer appended as tokens, and its
next turn is a request of its own: the prompt, every token so far (the engine's own ids, never
decoded and encoded again) and the answer, with one response, the remaining token budget and a
seed derived from the response's own, so a conversation does not depend on how requests are
shared out over engines or on when its turns are sent. Each conversation goes at its own pace: a
turn that comes back (engines stream samples as they finish) is answered by the agent in a thread
of its own (``rollout.agent.reply_threads`` at once), and the next turns ready at a moment go to
the engines together, at most ``TURN_BATCHES_IN_FLIGHT`` such batches out at once (more ready
turns wait for one to end) — no turn waits for the batch's longest answer. A conversation lives
in the driver, so an engine that dies mid-turn costs that turn only (the group sends it again to
the engine's replacement) and the turns before it are kept.

The sample of a conversation is its turns end to end (:func:`assemble`): the model's tokens with
their log μ, versions and routing validity, the environment's tokens marked
(``Sample.from_environment``) with log μ 0. With routing captured, each position's routed experts
come from the first turn that processed it: a turn's own positions are those after the previous
turn's last one, and a later turn asks the engine for those only (``routing_from``: SGLang sends
the rest of the sequence's routing, not the whole conversation's again), so every model token keeps the routing
that sampled it (R3 replays that) — except the tokens of a turn whose engine recomputed the
conversation's earlier positions instead of taking them from its prefix cache (another engine,
an evicted cache, newer weights, a pause inside the turn): they were sampled after that prefix's
new routing, which R3 does not replay, so they are masked for R3 and counted
(:func:`_prefix_rerouted`; ``Sample.prefix_rerouted_tokens``, ``rollout/r3_prefix_mismatch_frac``).
So that this stays rare, a turn goes to the engine that served the conversation's previous turn
(``GenerationRequest.affinity``: an engine group keeps it there unless that engine was replaced
or is full); the turns' hops and the prefix cache's hits are reported
(``Sample.conversation``: ``rollout/multi_turn_hop_frac``, ``rollout/prefix_cache_hit_rate``).

A turn that stops on anything but the call token ends the conversation (``stop``, or ``length``
at its budget); one that asks again after ``rollout.agent.max_turns`` model turns, or whose
answer would not fit the budget, ends it as cut off (``length``). An agent that raises ends its
conversation the same way; such calls are counted (:attr:`Conversations.errors`) and warned once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from bpo_megatron.rollout.agents.base import Agent, Turn
from bpo_megatron.rollout.types import ConversationStats, GenerationRequest, Sample, response_slots

log = logging.getLogger(__name__)

TURN_SEED_STRIDE = 104_729  # turn t of a response samples with its seed + t × this
# batches of turns one generation of conversations has at the engines at once (an engine runs as
# many generate calls side by side: orchestration.engine_group); more ready turns wait for one to end
TURN_BATCHES_IN_FLIGHT = 8
WAIT_S = 0.5  # a waiting loop looks at every batch of turns and every answer under way this often


class Conversations:
    """``engines`` (an engine group, or one engine: anything with ``generate``) talking to
    ``agent`` through ``tokenizer``; ``max_turns`` model turns per response at most; the agent
    answers ``reply_threads`` conversations at once."""

    def __init__(self, engines, agent: Agent, tokenizer, *, max_turns: int, reply_threads: int = 32) -> None:
        ids = tokenizer.encode(agent.call_token)
        if len(ids) != 1:
            raise ValueError(f"rollout.agent.call_token={agent.call_token!r} is {len(ids)} tokens of the run's "
                             "tokenizer; it must be exactly one (a turn stops on a token)")
        self.engines, self.agent, self.tokenizer, self.max_turns = engines, agent, tokenizer, max_turns
        self.reply_threads = reply_threads
        self.call_id = ids[0]
        self.errors = 0  # agent calls that raised (their conversations ended cut off)
        self._warned = False
        self._lock = threading.Lock()

    def submit(self, requests: list[GenerationRequest]) -> PendingConversations:
        first = [dataclasses.replace(r, sampling=dataclasses.replace(
            r.sampling, stop_token_ids=tuple(sorted({*r.sampling.stop_token_ids, self.call_id})))) for r in requests]
        return PendingConversations(self, first)

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        return self.submit(requests).result()

    def take_errors(self) -> int:
        """Agent calls that raised since the last call (``agent/errors``)."""
        with self._lock:
            errors, self.errors = self.errors, 0
        return errors

    # ---------------------------------------------------------------------------------- turns
    def send(self, requests: list[GenerationRequest]):
        """Turns to the engines, under way (an engine group's pending generation; a bare engine
        generates at once)."""
        submit = getattr(self.engines, "submit", None)
        return submit(requests) if submit is not None else _Done(self.engines.generate(requests))

    def ends(self, dialogue: _Dialogue) -> bool:
        """After the dialogue's latest model turn: whether it ends there (it does not ask, or may
        not ask again: ``max_turns``), its finish recorded."""
        last = dialogue.turns[-1]
        asks = (last.finish_reason == "stop" and last.response_tokens.numel() > 0
                and int(last.response_tokens[-1]) == self.call_id)
        if not asks:
            dialogue.finish = last.finish_reason
        elif len(dialogue.turns) == self.max_turns:  # it asks once more than it may
            dialogue.finish = "length"
        return dialogue.finish is not None

    def reply(self, dialogue: _Dialogue) -> str | None | Exception:
        """The agent's answer to the dialogue's latest turn (run in a reply thread)."""
        prompt = self.tokenizer.decode(dialogue.turns[0].prompt_tokens.tolist())
        try:
            return self.agent.respond(prompt, dialogue.transcript(self.tokenizer))
        except Exception as exc:  # noqa: BLE001 - a user's environment: counted, its conversation cut off
            return exc

    def append(self, dialogue: _Dialogue, reply: str | None | Exception) -> bool:
        """Add the agent's answer; False when the conversation ends here instead."""
        if reply is None:
            dialogue.finish = "stop"
            return False
        if isinstance(reply, Exception):
            with self._lock:
                self.errors += 1
                warn, self._warned = not self._warned, True
            if warn:
                log.warning("rollout.agent.name=%s raised %s: %s (its conversation ends cut off; such calls are "
                            "counted in agent/errors, warned once)", self.agent.settings.name,
                            type(reply).__name__, reply)
            dialogue.finish = "length"
            return False
        if not isinstance(reply, str):
            raise TypeError(f"rollout.agent.name={self.agent.settings.name}: respond() returned "
                            f"{type(reply).__name__}; it must return the environment's text (str) or None")
        ids = self.tokenizer.encode(reply)
        if dialogue.used + len(ids) + 1 > dialogue.request.sampling.max_new_tokens:  # no room for another turn
            dialogue.finish = "length"
            return False
        dialogue.environment.append(ids)
        return True


class _Done:
    """A bare engine's generation: finished when sent."""

    def __init__(self, samples: list[Sample]) -> None:
        self._samples, self._untaken = samples, list(enumerate(samples))

    def take_finished(self, wait_s: float = 0.0, *, watch: bool | None = None) -> list[tuple[int, Sample]]:
        taken, self._untaken = self._untaken, []
        return taken

    def done(self) -> bool:
        return True

    def result(self) -> list[Sample]:
        return self._samples


class PendingConversations:
    """Conversations under way, each at its own pace. :meth:`result` waits for all of them;
    :meth:`done` moves on as far as the turns that came allow, without waiting for the engines (it
    waits for the agent's answers under way), and says whether all are over."""

    def __init__(self, conversations: Conversations, requests: list[GenerationRequest]) -> None:
        self._conversations = conversations
        self._dialogues = [_Dialogue(slot.request, slot.seed, []) for slot in response_slots(requests)]
        # batches of turns at the engines: (the generation, the dialogue of each of its samples)
        self._batches: list[tuple[object, list[int]]] = [(conversations.send(requests),
                                                          list(range(len(self._dialogues))))]
        self._answering: dict[Future, int] = {}  # the agent's answers under way -> their dialogue
        self._ready: list[int] = []  # dialogues whose next turn waits for a batch to end
        self._replies = ThreadPoolExecutor(conversations.reply_threads, thread_name_prefix="agent-reply")
        self._samples: list[Sample] | None = None

    def result(self) -> list[Sample]:
        """Every response's conversation, in request order."""
        try:
            while self._samples is None:
                self._advance(WAIT_S, watch=True)
        except BaseException:
            self._replies.shutdown(wait=False, cancel_futures=True)
            raise
        return self._samples

    def done(self) -> bool:
        while self._samples is None:
            if self._advance(0.0, watch=False):
                continue
            if not self._answering:
                break
            self._take_answers(WAIT_S)  # the agent's calls are bounded (rollout.agent.timeout_s); engines are not
        return self._samples is not None

    def _advance(self, wait_s: float, *, watch: bool) -> bool:
        """Take the turns and answers that came (waiting up to ``wait_s`` when none has), send the
        next turns that are ready; whether anything came or went. ``watch``: the engines' stalls
        and deadlines are enforced (a wait that ends only with the conversations)."""
        moved = self._take_turns(0.0, watch) + self._take_answers(0.0)
        if not moved and wait_s > 0:
            share = wait_s / (len(self._batches) + bool(self._answering))
            moved = self._take_answers(share) + self._take_turns(share, watch)
        if self._ready and len(self._batches) < TURN_BATCHES_IN_FLIGHT:
            requests = [self._dialogues[i].next_request() for i in self._ready]
            self._batches.append((self._conversations.send(requests), self._ready))
            self._ready, moved = [], moved + len(requests)
        if not (self._batches or self._answering or self._ready):
            self._replies.shutdown()
            self._samples = [assemble(d.turns, d.environment, d.finish) for d in self._dialogues]
        return bool(moved)

    def _take_turns(self, wait_s: float, watch: bool) -> int:
        """The model turns that came back: end their conversations, or ask the agent."""
        taken = 0
        for batch in list(self._batches):
            generation, dialogues = batch
            finished = generation.take_finished(wait_s, watch=watch)
            if generation.done():
                finished += generation.take_finished()
                self._batches.remove(batch)
            for position, sample in finished:
                dialogue = self._dialogues[dialogues[position]]
                dialogue.turns.append(sample)
                if not self._conversations.ends(dialogue):
                    self._answering[self._replies.submit(self._conversations.reply, dialogue)] = dialogues[position]
            taken += len(finished)
        return taken

    def _take_answers(self, wait_s: float) -> int:
        """The agent's answers that came: append them, the conversation's next turn then ready."""
        if not self._answering:
            return 0
        answered, _ = wait(self._answering, timeout=wait_s, return_when=FIRST_COMPLETED)
        for future in answered:
            index = self._answering.pop(future)
            if self._conversations.append(self._dialogues[index], future.result()):
                self._ready.append(index)
        return len(answered)


@dataclasses.dataclass
class _Dialogue:
    request: GenerationRequest
    seed: int | None
    turns: list[Sample]  # the model's turns
    environment: list[list[int]] = dataclasses.field(default_factory=list)  # the answers after each turn
    finish: str | None = None

    @property
    def used(self) -> int:
        """Response tokens so far (model and environment)."""
        return sum(t.response_tokens.numel() for t in self.turns) + sum(len(e) for e in self.environment)

    def transcript(self, tokenizer) -> list[Turn]:
        turns = []
        for i, sample in enumerate(self.turns):
            turns.append(Turn(tokenizer.decode(sample.response_tokens.tolist())))
            if i < len(self.environment):
                turns.append(Turn(tokenizer.decode(self.environment[i]), from_environment=True))
        return turns

    def next_request(self) -> GenerationRequest:
        """The next model turn: everything so far as its prompt, one response."""
        turn = len(self.turns)  # 1: the second
        tokens = [*self.request.prompt_tokens]
        for i, sample in enumerate(self.turns):
            tokens += sample.response_tokens.tolist() + self.environment[i]
        first = self.turns[0]
        sampling = dataclasses.replace(
            self.request.sampling, n=1, max_new_tokens=self.request.sampling.max_new_tokens - self.used,
            seed=None if self.seed is None else self.seed + turn * TURN_SEED_STRIDE)
        last = self.turns[-1]  # the positions the turns so far reported: only the rest is asked for
        known = 0 if last.routed_experts is None else last.routing_start + last.routed_experts.shape[0]
        return GenerationRequest(f"{first.request_id}#{first.index}/t{turn}", tuple(tokens), sampling,
                                 capture_routing=self.request.capture_routing, routing_from=known,
                                 affinity=last.served_by)


def assemble(turns: list[Sample], environment: list[list[int]], finish: str) -> Sample:
    """One sample from a conversation's model turns and the environment's answers between them."""
    first, pieces = turns[0], []
    for i, sample in enumerate(turns):
        pieces.append((sample, None))
        if i < len(turns) - 1:
            pieces.append((None, torch.tensor(environment[i], dtype=torch.long)))
    response = torch.cat([s.response_tokens if s is not None else e for s, e in pieces])
    logprobs = torch.cat([s.rollout_logprobs if s is not None else torch.zeros(e.numel()) for s, e in pieces])
    from_env = torch.cat([torch.zeros(s.response_tokens.numel(), dtype=torch.bool) if s is not None
                          else torch.ones(e.numel(), dtype=torch.bool) for s, e in pieces])
    versions = None
    if all(s.token_versions is not None for s in turns):
        parts = []
        for sample, answer in pieces:  # an answer is dated like the model token that asked for it
            parts.append(sample.token_versions if sample is not None else parts[-1][-1:].expand(answer.numel()))
        versions = torch.cat(parts)
    routing = _routing(turns)
    rerouted, stats = _prefix_rerouted(turns, routing)
    valid = None
    if any(s.routing_valid is not None for s in turns) or any(rerouted):
        own = {id(s): torch.zeros(s.response_tokens.numel(), dtype=torch.bool) if moved
               else s.routing_valid if s.routing_valid is not None
               else torch.ones(s.response_tokens.numel(), dtype=torch.bool) for s, moved in zip(turns, rerouted)}
        valid = torch.cat([own[id(s)] if s is not None else torch.ones(e.numel(), dtype=torch.bool) for s, e in pieces])
    return Sample(request_id=first.request_id, index=first.index, prompt_tokens=first.prompt_tokens,
                  response_tokens=response, rollout_logprobs=logprobs, finish_reason=finish,
                  routed_experts=routing, weight_version=min(s.weight_version for s in turns),
                  token_versions=versions, routing_valid=valid, from_environment=from_env,
                  retracted_for_space=any(s.retracted_for_space for s in turns),
                  prefix_rerouted_tokens=sum(s.response_tokens.numel() for s, moved in zip(turns, rerouted) if moved),
                  conversation=stats)


def _prefix_rerouted(turns: list[Sample], routing: torch.Tensor | None) -> tuple[list[bool], ConversationStats]:
    """Per turn: whether its tokens were sampled after a routing of the conversation's earlier
    positions (those the turns before it fed) other than the one R3 replays for them — each
    position's routing from the first turn that processed it (``routing``, assembled). The
    evidence, best first:

    - the turn reports the routing of those positions itself (an engine that recomputes the whole
      sequence and ignores ``routing_from``: the embedded engine, vLLM): they are compared;
    - the engine says how much of the turn's prompt it took from its prefix cache (SGLang's
      ``cached_tokens``): less than the earlier positions means it recomputed the rest — on
      another engine, after an eviction, or with other weights (an update flushes the cache);
      and a turn paused by a re-prefilling pause (its tokens span two weights versions) had the
      whole conversation prefilled again with the new weights, which ``cached_tokens``, counted at
      the first prefill only, does not show;
    - otherwise only versions tell: the turn's first token was sampled by other weights than the
      previous turn's last (an update between them empties every cache), or the turn was paused.

    Without the prefix's rows to compare, a turn after one that recomputed the earlier positions
    (or was retracted, which prefills every position again) is masked too: the cache it reuses
    holds that recomputation, not the routing replayed.

    Also the turns' :class:`ConversationStats`."""
    rerouted, hops, prefix_tokens, cached, recomputed = [False], 0, 0, 0, 0
    broken = False  # the cached path: a turn before recomputed the earlier positions, its cache holds that
    for previous, turn in zip(turns, turns[1:]):
        fed = previous.prompt_tokens.numel() + previous.response_tokens.numel() - 1  # the earlier positions
        hops += previous.served_by is not None and turn.served_by != previous.served_by
        if turn.cached_tokens is not None:
            prefix_tokens += fed
            cached += min(turn.cached_tokens, fed)
        if (routing is not None and turn.routed_experts is not None and turn.routing_start < fed):
            own = turn.routed_experts[: fed - turn.routing_start]
            moved = not torch.equal(own, routing[turn.routing_start:fed].to(own.dtype))
        else:
            paused = turn.token_versions is not None and bool((turn.token_versions != _first(turn)).any())
            moved = broken or _first(turn) != _last(previous) or paused or (
                turn.cached_tokens is not None and turn.cached_tokens < fed)
            broken = moved or turn.retracted_for_space  # a retraction prefilled every position again
        rerouted.append(moved)
        recomputed += moved
    return rerouted, ConversationStats(later_turns=len(turns) - 1, hops=hops, prefix_tokens=prefix_tokens,
                                       cached_prefix_tokens=cached, recomputed_turns=recomputed)


def _first(sample: Sample) -> int:
    """The weights version that sampled the sample's first token."""
    versions = sample.token_versions
    return int(versions[0]) if versions is not None and versions.numel() else sample.weight_version


def _last(sample: Sample) -> int:
    versions = sample.token_versions
    return int(versions[-1]) if versions is not None and versions.numel() else sample.weight_version


def _routing(turns: list[Sample]) -> torch.Tensor | None:
    """Each position's experts from the first turn that processed it (None unless every turn has them).
    A later turn reports positions from its ``routing_start`` on (the earlier turns' are not asked
    again where the engine can leave them out)."""
    if any(s.routed_experts is None for s in turns):
        return None
    parts, start = [], 0
    for sample in turns:
        end = sample.prompt_tokens.numel() + sample.response_tokens.numel() - 1  # the positions it fed
        offset = sample.routing_start
        if sample.routed_experts.shape[0] != end - offset or offset > start:
            raise ValueError(f"turn {sample.request_id}: routed experts for positions {offset}…"
                             f"{offset + sample.routed_experts.shape[0]}, expected {start}…{end} at least")
        parts.append(sample.routed_experts[start - offset:end - offset])
        start = end
    return torch.cat(parts)


def with_agent(engines, agent: Agent | None, tokenizer):
    """What generates a run's responses: ``engines`` themselves (single-turn), or conversations of
    theirs with ``agent`` (as its settings say: ``rollout.agent``)."""
    if agent is None:
        return engines
    return Conversations(engines, agent, tokenizer, max_turns=agent.settings.max_turns,
                         reply_threads=agent.settings.reply_threads)
