"""Multi-turn rollouts (``rollout.agent``): conversations over an engine, token in and token out.

A scripted engine answers each turn with tokens fixed per (response, turn), log μ that name the
turn and the position, routing whose every row says which turn reported it, and a weights version
per turn: so the assembled sample shows exactly where each of its pieces came from. Then the real
embedded engine (the calculator on a random tiny MoE, whose rare "]" tokens call it) scored by a
Megatron trainer with R3; and an engine group whose engine dies between a conversation's turns.
"""

from __future__ import annotations

import dataclasses
import os
import re
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from bpo_megatron.data.tokenizer import CharTokenizer
from bpo_megatron.loop.samples import environment_turns, training_samples
from bpo_megatron.rollout import GenerationRequest, Sample, SamplingParams
from bpo_megatron.rollout.agents import Agent, AgentConfig, Conversations, Turn, load_agent
from bpo_megatron.rollout.agents.calculator import calculate
from bpo_megatron.rollout.agents.conversation import TURN_SEED_STRIDE, assemble
from bpo_megatron.rollout.agents.python_tool import run_python
from bpo_megatron.rollout.types import response_slots
from bpo_megatron.tasks.scoring import response_texts
from loop_helpers import Interrupted, run_loop
from bpo_megatron.testing import MODEL_CONFIGS

TOK = CharTokenizer()
EOS = TOK.eos_token_ids[0]
CALL = TOK.encode("]")[0]
LAYERS, TOPK = 2, 2


def ids(text: str, *, eos: bool = False) -> list[int]:
    return TOK.encode(text) + ([EOS] if eos else [])


class ScriptedEngine:
    """Answers turn t of response ``key`` (``q0#1``) with ``scripts[key][t]``; log μ of position
    i of turn t is −(t + 1)/10 − i/1000, every routing row of turn t holds t + 1, and turn t was
    sampled by weights version 5 + t. Records the requests it was given."""

    def __init__(self, scripts: dict[str, list[list[int]]]) -> None:
        self.scripts, self.requests = scripts, []

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        self.requests.append(requests)
        out = []
        for slot in response_slots(requests):
            rid = slot.request.request_id
            key, turn = (rid.rsplit("/t", 1)[0], int(rid.rsplit("/t", 1)[1])) if "/t" in rid else (slot.rid, 0)
            script = self.scripts[key][turn][: slot.request.sampling.max_new_tokens]
            stops = set(slot.request.sampling.stop_token_ids)
            end = next((i + 1 for i, t in enumerate(script) if t in stops), len(script))
            tokens = torch.tensor(script[:end], dtype=torch.long)
            prompt = torch.tensor(slot.request.prompt_tokens, dtype=torch.long)
            rows = prompt.numel() + tokens.numel() - 1
            out.append(Sample(request_id=rid, index=slot.index, prompt_tokens=prompt, response_tokens=tokens,
                              rollout_logprobs=-(turn + 1) / 10 - torch.arange(tokens.numel()) / 1000,
                              finish_reason="stop" if int(tokens[-1]) in stops else "length",
                              routed_experts=torch.full((rows, LAYERS, TOPK), turn + 1, dtype=torch.uint8),
                              weight_version=5 + turn, token_versions=torch.full((tokens.numel(),), 5 + turn)))
        return out


def request(prompt: str = "2*3=", n: int = 1, max_new_tokens: int = 20, seed: int = 7) -> GenerationRequest:
    return GenerationRequest("q0", tuple(ids(prompt)), SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed,
                                                                      stop_token_ids=(EOS,)))


def calculator(**settings) -> Agent:
    return load_agent(AgentConfig(name="calculator", **settings))


# ------------------------------------------------------------------------ conversations
def test_a_conversation_is_its_turns_end_to_end():
    engine = ScriptedEngine({"q0#0": [ids("[2*3]xx"), ids("6", eos=True)]})
    conversations = Conversations(engine, calculator(), TOK, max_turns=3)
    [sample] = conversations.generate([request()])
    prompt = ids("2*3=")
    # the tokens: the model's first turn up to the call token, the answer, the model's last turn
    assert sample.response_tokens.tolist() == ids("[2*3]") + ids("=6;") + ids("6", eos=True)
    env = [False] * 5 + [True] * 3 + [False] * 2
    assert sample.from_environment.tolist() == env
    assert sample.model_tokens.tolist() == [not e for e in env]
    # log μ: the model's tokens as sampled, turn by turn; exactly 0 (none) on the answer
    expected = [-0.1 - i / 1000 for i in range(5)] + [0.0] * 3 + [-0.2 - i / 1000 for i in range(2)]
    torch.testing.assert_close(sample.rollout_logprobs, torch.tensor(expected), rtol=0, atol=1e-7)
    assert torch.equal(sample.rollout_logprobs[sample.from_environment], torch.zeros(3))
    # routing: each position from the first turn that processed it. Turn 0 fed positions
    # [0, P + 5 − 1); turn 1 the rest: the call token, the answer and its own tokens but the last
    rows = len(prompt) + 10 - 1
    assert sample.routed_experts.shape == (rows, LAYERS, TOPK)
    assert sample.routed_experts[:, 0, 0].tolist() == [1] * (len(prompt) + 4) + [2] * 5
    # versions: each token the turn's; the answer dated like the call; the sample as old as its oldest
    assert sample.token_versions.tolist() == [5] * 5 + [5] * 3 + [6] * 2
    assert sample.weight_version == 5 and sample.finish_reason == "stop"
    # an update (5 -> 6) came between the turns: the engine re-prefilled the conversation with the new
    # weights before sampling turn 1, whose tokens followed that routing of the prefix, not the turn-0
    # routing R3 replays for it: turn 1's tokens are masked for R3 and counted
    assert sample.routing_valid.tolist() == [True] * 8 + [False] * 2 and sample.prefix_rerouted_tokens == 2
    sample.check(num_moe_layers=LAYERS, topk=TOPK)
    # what the reward reads: the model's last turn
    assert response_texts([sample], TOK) == ["6"] and sample.final_turn.tolist() == ids("6", eos=True)
    # the second turn: everything so far as its prompt (the engine's ids), one response, the budget
    # left, a seed of its own, and the call token among the stop tokens of both turns
    first, second = engine.requests[0][0], engine.requests[1][0]
    assert CALL in first.sampling.stop_token_ids and EOS in first.sampling.stop_token_ids
    assert second.request_id == "q0#0/t1"
    assert list(second.prompt_tokens) == prompt + ids("[2*3]=6;")
    assert second.sampling.n == 1 and second.sampling.max_new_tokens == 20 - 8
    assert second.sampling.seed == 7 + TURN_SEED_STRIDE
    assert second.sampling.stop_token_ids == first.sampling.stop_token_ids
    assert environment_turns(sample) == 1 and conversations.take_errors() == 0


def test_each_response_of_a_request_is_its_own_conversation():
    """n = 3: one answers at once, one calls twice, one calls once; the seeds follow each response's."""
    engine = ScriptedEngine({"q0#0": [ids("5", eos=True)],
                             "q0#1": [ids("[1+1]"), ids("[2+2]"), ids("4", eos=True)],
                             "q0#2": [ids("[9-1]"), ids("8", eos=True)]})
    samples = Conversations(engine, calculator(), TOK, max_turns=3).generate([request(n=3, max_new_tokens=30)])
    assert [(s.request_id, s.index) for s in samples] == [("q0", 0), ("q0", 1), ("q0", 2)]
    assert [response_texts([s], TOK)[0] for s in samples] == ["5", "4", "8"]
    assert [environment_turns(s) for s in samples] == [0, 2, 1]
    assert not samples[0].from_environment.any() and samples[0].routed_experts[:, 0, 0].eq(1).all()
    assert TOK.decode(samples[1].response_tokens.tolist()) == "[1+1]=2;[2+2]=4;4"
    # a second turn for responses 1 and 2, a third for response 1 (each sent when its answer came: in
    # one batch or two, as the agent's threads finish); the seeds follow each response's
    sent = {r.request_id: r.sampling.seed for batch in engine.requests[1:] for r in batch}
    assert engine.requests[0][0].request_id == "q0"
    assert sent == {"q0#1/t1": 8 + TURN_SEED_STRIDE, "q0#2/t1": 9 + TURN_SEED_STRIDE,
                    "q0#1/t2": 8 + 2 * TURN_SEED_STRIDE}


class _Later:
    """A generation under way until ``ready`` is set (an engine group's pending generation)."""

    def __init__(self, samples, ready) -> None:
        self.samples, self.ready, self.taken = samples, ready, False

    def take_finished(self, wait_s: float = 0.0, *, watch=None):
        if not self.ready[0] or self.taken:
            return []
        self.taken = True
        return list(enumerate(self.samples))

    def done(self) -> bool:
        return self.ready[0]

    def result(self):
        assert self.ready[0], "result() would have waited"
        return self.samples


class SlowGroup(ScriptedEngine):
    """The scripted engine behind ``submit``: each round's samples wait for ``ready``."""

    def __init__(self, scripts) -> None:
        super().__init__(scripts)
        self.ready = [False]

    def submit(self, requests):
        return _Later(self.generate(requests), self.ready)


def test_a_pending_conversation_moves_on_without_waiting():
    """``done()`` (what a background evaluation polls) sends the next round as soon as a round is
    back, and never waits for one; ``result()`` then equals a conversation generated at once."""
    group = SlowGroup({"q0#0": [ids("[1+1]"), ids("[2+2]"), ids("4", eos=True)], "q0#1": [ids("3", eos=True)]})
    pending = Conversations(group, calculator(), TOK, max_turns=3).submit([request(n=2)])
    assert not pending.done() and len(group.requests) == 1
    group.ready[0] = True
    assert pending.done() and len(group.requests) == 3  # the two later rounds went out within one call
    direct = Conversations(ScriptedEngine(group.scripts), calculator(), TOK, max_turns=3).generate([request(n=2)])
    for got, want in zip(pending.result(), direct, strict=True):
        assert torch.equal(got.response_tokens, want.response_tokens)
        assert torch.equal(got.from_environment, want.from_environment)


class _Streaming:
    """A generation whose samples come back one by one as an engine group's do, those of the
    responses in ``held`` only once ``release`` is set."""

    def __init__(self, samples, held: set[str], release: threading.Event, log: list) -> None:
        self.samples, self.held, self.release, self.log = samples, held, release, log
        self.untaken = set(range(len(samples)))

    def take_finished(self, wait_s: float = 0.0, *, watch=None):
        came = [(i, self.samples[i]) for i in sorted(self.untaken)
                if self.release.is_set() or _key(self.samples[i]) not in self.held]
        self.untaken -= {i for i, _ in came}
        self.log += [("came", _key(sample)) for _, sample in came]
        if not came and wait_s:
            time.sleep(min(wait_s, 0.01))
        return came

    def done(self) -> bool:
        return not self.untaken

    def result(self):
        return self.samples


def _key(sample) -> str:
    """``q0#1/t1`` for the second turn of response 1 of q0."""
    turn = sample.request_id.rsplit("/t", 1)
    return f"{turn[0]}/t{turn[1]}" if len(turn) == 2 else f"{sample.request_id}#{sample.index}/t0"


class StreamingGroup(ScriptedEngine):
    def __init__(self, scripts, held: set[str]) -> None:
        super().__init__(scripts)
        self.held, self.release, self.log = held, threading.Event(), []

    def submit(self, requests):
        self.log += [("sent", _key(s)) for s in (sample for sample in self.generate(requests))]
        return _Streaming(self.requests_samples, self.held, self.release, self.log)

    def generate(self, requests):
        self.requests_samples = super().generate(requests)
        return self.requests_samples


def test_a_conversation_goes_on_while_another_is_still_generating():
    """Response 0's first turn is long (held back); response 1's first turn comes back at once:
    its tool is called and its second turn sent (and back) before response 0's first turn ends.
    The conversations then equal those generated round by round."""
    scripts = {"q0#0": [ids("[1+1]"), ids("2", eos=True)], "q0#1": [ids("[2+2]"), ids("4", eos=True)]}
    group = StreamingGroup(scripts, held={"q0#0/t0"})
    pending = Conversations(group, calculator(), TOK, max_turns=3).submit([request(n=2)])
    deadline = time.monotonic() + 10
    while ("came", "q0#1/t1") not in group.log and time.monotonic() < deadline:
        assert not pending.done()
    assert ("came", "q0#1/t1") in group.log, f"response 1's second turn waited for response 0's first: {group.log}"
    assert ("came", "q0#0/t0") not in group.log
    group.release.set()
    samples = pending.result()
    assert group.log.index(("came", "q0#1/t1")) < group.log.index(("came", "q0#0/t0")) < group.log.index(
        ("sent", "q0#0/t1"))
    direct = Conversations(ScriptedEngine(scripts), calculator(), TOK, max_turns=3).generate([request(n=2)])
    assert [TOK.decode(s.response_tokens.tolist()) for s in samples] == ["[1+1]=2;2", "[2+2]=4;4"]
    for got, want in zip(samples, direct, strict=True):
        assert torch.equal(got.response_tokens, want.response_tokens)
        assert torch.equal(got.from_environment, want.from_environment)
        assert torch.equal(got.routed_experts, want.routed_experts)


def test_reply_threads_is_checked():
    with pytest.raises(ValueError, match=r"rollout.agent.reply_threads must be >= 1"):
        AgentConfig(name="calculator", reply_threads=0)


@pytest.mark.parametrize("case, finish, text", [
    ("asks once more than max_turns allows", "length", "[1+1]=2;[2+2]"),
    ("the answer would not fit the budget", "length", "[1+1]"),
    ("the budget ends a turn", "length", "[1+1]=2;444"),
])
def test_conversations_end_cut_off_at_their_limits(case, finish, text):
    scripts = {"q0#0": [ids("[1+1]"), ids("[2+2]"), ids("4", eos=True)]}
    max_turns, budget = 2, 30
    if case == "the answer would not fit the budget":
        budget = 7  # 5 tokens, then "=2;" (3) and one more token would be 9
    if case == "the budget ends a turn":
        scripts, budget = {"q0#0": [ids("[1+1]"), ids("4444444", eos=True)]}, 11
    [sample] = Conversations(ScriptedEngine(scripts), calculator(), TOK, max_turns=max_turns).generate(
        [request(max_new_tokens=budget)])
    assert TOK.decode(sample.response_tokens.tolist()) == text and sample.finish_reason == finish
    assert sample.response_tokens.numel() <= budget


class Ending(Agent):
    call_token = "]"

    def respond(self, prompt, transcript):
        return None if transcript[-1].text.startswith("[end") else f"<{prompt}|{len(transcript)}>"


class Raising(Agent):
    call_token = "]"

    def respond(self, prompt, transcript):
        raise KeyError("no tool here")


def test_an_agent_that_ends_or_raises_ends_the_conversation(caplog):
    engine = ScriptedEngine({"q0#0": [ids("[end]")], "q0#1": [ids("[go]"), ids("ok", eos=True)]})
    settings = AgentConfig(name=f"{__name__}:Ending")
    samples = Conversations(engine, Ending(settings), TOK, max_turns=4).generate([request(n=2, max_new_tokens=40)])
    assert [s.finish_reason for s in samples] == ["stop", "stop"]
    assert TOK.decode(samples[0].response_tokens.tolist()) == "[end]"
    # the agent reads the prompt as the model saw it and the transcript so far
    assert TOK.decode(samples[1].response_tokens.tolist()) == "[go]<2*3=|1>ok"
    raising = Conversations(ScriptedEngine({"q0#0": [ids("[a]")], "q0#1": [ids("7", eos=True)]}),
                            Raising(AgentConfig(name=f"{__name__}:Raising")), TOK, max_turns=4)
    with caplog.at_level("WARNING"):
        samples = raising.generate([request(n=2)])
    assert [s.finish_reason for s in samples] == ["length", "stop"]  # cut off: scored as truncated
    assert raising.take_errors() == 1 and raising.take_errors() == 0
    assert len([r for r in caplog.records if "raised KeyError" in r.getMessage()]) == 1


def test_environment_tokens_are_out_of_the_loss_and_counted():
    engine = ScriptedEngine({"q0#0": [ids("[2*3]"), ids("6", eos=True)], "q0#1": [ids("6", eos=True)]})
    samples = Conversations(engine, calculator(), TOK, max_turns=3).generate([request(n=2)])
    # R3 left a token of the last turn out (its routing was recomputed by other weights)
    samples[0] = dataclasses.replace(samples[0], routing_valid=torch.tensor([True] * 9 + [False]))
    train, metrics = training_samples(samples, torch.tensor([1.0, 0.0]), group_size=2, keep_routing=True,
                                      asynchronous=True)
    assert train[0].train_mask.tolist() == [True] * 5 + [False] * 3 + [True, False]
    assert train[1].train_mask.tolist() == [True, True]
    assert train[0].num_train_tokens == 6 and train[0].num_response_tokens == 10
    assert metrics["agent/tool_calls_mean"] == 0.5
    assert metrics["agent/env_token_frac"] == pytest.approx(3 / 12)
    assert metrics["async/r3_masked_frac"] == pytest.approx(1 / 9)  # of the model's 9 tokens
    # the second turn of the first conversation came after an update (its 2 tokens masked by assemble)
    assert metrics["rollout/r3_prefix_mismatch_frac"] == pytest.approx(samples[0].prefix_rerouted_tokens / 9)
    assert samples[0].prefix_rerouted_tokens == 2 and samples[1].prefix_rerouted_tokens == 0
    plain, _ = training_samples(samples, torch.tensor([1.0, 0.0]), group_size=2, keep_routing=False)
    assert plain[0].train_mask.tolist() == [True] * 5 + [False] * 3 + [True] * 2


def _turn(prompt: int, response: int, *, start: int, fill: int, versions: list[int], cached: int | None,
          engine: tuple[int, int] | None) -> Sample:
    """A model turn as an engine reports it: routing rows from ``start`` on, each holding ``fill``."""
    rows = prompt + response - 1 - start
    return Sample(request_id="q0", index=0, prompt_tokens=torch.arange(prompt), response_tokens=torch.arange(response),
                  rollout_logprobs=torch.full((response,), -0.5), finish_reason="stop",
                  routed_experts=torch.full((rows, LAYERS, TOPK), fill, dtype=torch.uint8), routing_start=start,
                  weight_version=min(versions), token_versions=torch.tensor(versions), cached_tokens=cached,
                  served_by=engine)


@pytest.mark.parametrize("case, second, masked", [
    # SGLang: the second turn asks for the positions after the first's 6 only (routing_from)
    ("its prefix cached on the same engine", dict(start=6, cached=6, engine=(0, 0)), False),
    ("the cache lost part of it (an eviction)", dict(start=6, cached=4, engine=(0, 0)), True),
    ("another engine, whose cache lacks it", dict(start=6, cached=0, engine=(1, 0)), True),
    ("a replacement of the engine", dict(start=6, cached=0, engine=(0, 1)), True),
    ("an update between the turns", dict(start=6, cached=6, engine=(0, 0), versions=[6, 6]), True),
    # a pause inside the turn re-prefilled every position with the new weights; cached_tokens
    # (counted at the first prefill) does not show it
    ("a pause inside the turn", dict(start=6, cached=6, engine=(0, 0), versions=[5, 6]), True),
    # an engine that recomputes the whole sequence and reports it: the routing itself is compared
    ("recomputed with the same routing", dict(start=0, cached=0, engine=(1, 0), prefix_fill=1), False),
    ("recomputed with other routing", dict(start=0, cached=0, engine=(0, 0), prefix_fill=3), True),
])
def test_a_later_turn_is_masked_for_r3_exactly_when_its_prefix_routing_was_recomputed(case, second, masked):
    """A second turn is sampled after the engine's routing of the first turn's positions; R3 replays
    the first turn's. Its tokens are masked (and counted) exactly when the two can differ, and the
    turns' hops and prefix-cache hits are reported."""
    first = _turn(4, 3, start=0, fill=1, versions=[5, 5, 5], cached=0, engine=(0, 0))
    second = dict(second)
    versions = second.pop("versions", [5, 5])
    prefix_fill = second.pop("prefix_fill", None)
    turn = _turn(9, 2, fill=2, versions=versions, **second)
    if prefix_fill is not None:  # the positions the first turn fed, as this engine routed them
        turn.routed_experts[:6] = prefix_fill
    sample = assemble([first, turn], [[7, 8]], "stop")
    valid = [True] * 7 if sample.routing_valid is None else sample.routing_valid.tolist()
    assert valid == [True] * 5 + [not masked] * 2, case
    assert sample.prefix_rerouted_tokens == 2 * masked
    stats = sample.conversation
    hop = turn.served_by != (0, 0)
    assert (stats.later_turns, stats.hops, stats.recomputed_turns) == (1, hop, masked)
    assert (stats.prefix_tokens, stats.cached_prefix_tokens) == (6, second["cached"])
    # the replayed routing: the first turn's rows for its positions, the second's for the rest
    assert sample.routed_experts[:, 0, 0].tolist() == [1] * 6 + [2] * 4
    _, metrics = training_samples([sample, sample], torch.tensor([1.0, 0.0]), group_size=2, keep_routing=True)
    assert metrics["rollout/multi_turn_hop_frac"] == hop
    assert metrics["rollout/prefix_cache_hit_rate"] == pytest.approx(second["cached"] / 6)
    assert metrics["rollout/multi_turn_prefix_recomputed_frac"] == masked
    assert metrics["rollout/r3_prefix_mismatch_frac"] == pytest.approx(2 * masked / 5)


def test_a_turn_that_reuses_a_recomputed_prefix_is_masked_too():
    """The second turn hopped to engine 1, which recomputed the first turn's positions; the third
    stays there and reuses its cache whole — which holds engine 1's routing of those positions,
    not engine 0's that R3 replays: masked too."""
    first = _turn(4, 3, start=0, fill=1, versions=[5, 5, 5], cached=0, engine=(0, 0))
    second = _turn(9, 2, start=6, fill=2, versions=[5, 5], cached=0, engine=(1, 0))
    third = _turn(13, 2, start=10, fill=3, versions=[5, 5], cached=10, engine=(1, 0))
    sample = assemble([first, second, third], [[7, 8], [7, 8]], "stop")
    assert sample.routing_valid.tolist() == [True] * 5 + [False] * 2 + [True] * 2 + [False] * 2
    stats = sample.conversation
    assert (stats.later_turns, stats.hops, stats.recomputed_turns) == (2, 1, 2)
    assert (stats.prefix_tokens, stats.cached_prefix_tokens) == (16, 10)


def test_a_call_token_must_be_one_token():
    with pytest.raises(ValueError, match=r"rollout.agent.call_token='</tool_call>' is 12 tokens"):
        Conversations(ScriptedEngine({}), load_agent(AgentConfig(name="python_tool")), TOK, max_turns=2)


# ------------------------------------------------------------------------------ built-ins
@pytest.mark.parametrize("expression, value", [
    ("37*58", "2146"), ("(2+3)*-4", "-20"), ("7//2", "3"), ("1/4", "0.25"), ("2**10", "1024"), ("10/4*2", "5"),
    ("2**100000", "error"), ("9" * 31, "error"), ("__import__('os')", "error"), ("1/0", "error"), ("3*", "error"),
    ("abs(-2)", "error"), ("", "error")])
def test_the_calculator_evaluates_arithmetic_only(expression, value):
    assert calculate(expression) == value


def test_the_calculator_answers_what_follows_the_last_bracket():
    agent = calculator()
    assert agent.respond("x", [Turn("so [12*3]")]) == "=36;"
    assert agent.respond("x", [Turn("[1]"), Turn("=1;", True), Turn("then [2+2]")]) == "=4;"
    assert agent.demonstration("12*3", "36") == [Turn("[12*3]"), Turn("=36;", True), Turn("36")]
    assert calculator(reply="<{output}>", call_token=")").respond("x", [Turn("[5*5)")]) == "<25>"


def test_the_python_tool_runs_code_apart_and_bounded(confinable):
    assert run_python("print(6 * 7)", timeout_s=30) == "42"
    assert run_python("import sys; sys.exit(3)", timeout_s=30) == "exit status 3"
    assert run_python("1 / 0", timeout_s=30) == "ZeroDivisionError: division by zero"
    assert run_python("import time; time.sleep(30)", timeout_s=1) == "TimeoutError: the code ran past 1 s"
    agent = load_agent(AgentConfig(name="python_tool", timeout_s=30))
    reply = agent.respond("p", [Turn("Let me compute.<tool_call>print(sum(range(10)))</tool_call>")])
    assert reply == "<tool_response>\n45\n</tool_response>\n"


# ------------------------------------------------------------------------- before the run
USER_AGENT = textwrap.dedent('''
    from bpo_megatron.rollout.agents import Agent, Turn

    class Echo(Agent):
        call_token = "]"
        reply = "({output})"

        def respond(self, prompt, transcript):
            return self.format_reply(transcript[-1].text[1:-1])

        def demonstration(self, problem, answer):
            return [Turn("[x]"), Turn("(x)", True), Turn(answer)]

    class Liar(Echo):
        def demonstration(self, problem, answer):
            return [Turn("[x]"), Turn("(y)", True), Turn(answer)]

    class Unordered(Echo):
        def demonstration(self, problem, answer):
            return [Turn("[x]"), Turn(answer)]

    class NotAnAgent:
        pass
''')


@pytest.fixture
def user_agents(tmp_path, monkeypatch) -> str:
    (tmp_path / "user_agents_demo.py").write_text(USER_AGENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_agents_demo"


def _check(capsys, *overrides: str) -> tuple[int, str]:
    from bpo_megatron.cli import main

    code = main(["train", str(Path(__file__).resolve().parents[1] / "configs" / "calculator_cpu.yaml"), *overrides,
                 "--check"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


REFUSED = {
    "a call token of several tokens": ("rollout.agent.call_token=</tool_call>",
                                       r"rollout.agent.call_token='</tool_call>' \(rollout.agent.name=calculator\) is "
                                       r"12 tokens of the run's tokenizer \(char\); a model turn stops on one token"),
    "an unknown agent": ("rollout.agent.name=abacus", r"rollout.agent.name='abacus' is unknown; choose one of "
                                                      r"\['calculator', 'python_tool'\], package.module:Class"),
    "a module that is missing": ("rollout.agent.name=no_such_agents:Tool",
                                 r"rollout.agent.name='no_such_agents:Tool': module 'no_such_agents' cannot be "
                                 r"imported .* is its directory on PYTHONPATH\?"),
    "not an Agent": ("rollout.agent.name={m}:NotAnAgent", r"'NotAnAgent' in user_agents_demo is not a subclass of "
                                                          r"bpo_megatron.rollout.agents.Agent"),
    "a demonstration the agent contradicts": (
        "rollout.agent.name={m}:Liar", r"rollout.agent.name=user_agents_demo:Liar: the demonstration of the first "
                                       r"training record \(id 'mul2-.*'\): turn 1 says the environment answers "
                                       r"'\(y\)', but respond\(\) answers '\(x\)'"),
    "a demonstration out of order": ("rollout.agent.name={m}:Unordered", r"turn 1 \('\d+'\) is out of order"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_agent_is_refused_before_anything_starts(case, user_agents, tmp_path, capsys):
    override, message = REFUSED[case]
    run_dir = tmp_path / "run"
    code, output = _check(capsys, override.format(m=user_agents), f"logging.run_dir={run_dir}")
    assert code == 2, output
    assert re.search(message, output), output
    assert not run_dir.exists()


def test_a_user_agent_that_agrees_with_its_demonstration_passes(user_agents, tmp_path, capsys):
    code, output = _check(capsys, f"rollout.agent.name={user_agents}:Echo", f"logging.run_dir={tmp_path / 'run'}")
    assert code == 0, output


def test_a_warm_start_imitates_the_model_turns_of_a_demonstration():
    from bpo_megatron.data.problems import Problem
    from bpo_megatron.loop.sft import demonstrated

    problem = Problem(id="p", problem="12*3", answer="36")
    sample = demonstrated(ids("12*3="), problem, TOK, calculator())
    assert sample.tokens.tolist() == ids("12*3=") + ids("[12*3]=36;36", eos=True)
    assert sample.train_mask.tolist() == [True] * 6 + [False] * 4 + [True] * 3
    plain = demonstrated(ids("12*3="), problem, TOK)
    assert plain.tokens.tolist() == ids("12*3=36", eos=True) and plain.train_mask is None


# ------------------------------------------------------- the embedded engine and the trainer
FIXTURE = MODEL_CONFIGS / "tiny_qwen3_moe"
MEAN_TOLERANCE, MAX_TOLERANCE = 1e-5, 1e-4  # fp32, as tests/test_rollout_trainer_agreement.py


def _engine_requests() -> list[GenerationRequest]:
    """Prompts a random model answers with any token: its "]" (one in 97 draws of the char
    alphabet, more with the model's extra ids) calls the calculator in some of 1,024 responses."""
    return [GenerationRequest(f"m{i}", tuple(ids(f"{10 + i}*{20 + 3 * i}=")),
                              SamplingParams(n=64, max_new_tokens=14, seed=100 + i, stop_token_ids=(EOS,)))
            for i in range(16)]


def _multi_turn_agreement(model_dir: str) -> dict:
    from bpo_megatron import testing as th
    from bpo_megatron.rollout.hf.engine import HFEngine

    engine = HFEngine(model_dir, capture_routing=True)
    samples = Conversations(engine, calculator(), TOK, max_turns=3).generate(_engine_requests())
    talking = [s for s in samples if s.from_environment.any()]
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(talking))])
    train, _ = training_samples(talking, rewards, group_size=len(talking), keep_routing=True)
    train = [dataclasses.replace(t, advantage=1.0 if i % 2 else -1.0) for i, t in enumerate(train)]
    actor = th.build_actor(model_dir, replay=True, micro_batch_size=8, weights=model_dir, loss="bpo")
    scored = actor.compute_logprobs(train)
    model_gaps = torch.cat([(lp - s.rollout_logprobs)[s.model_tokens].abs() for lp, s in zip(scored.logprobs, talking)])
    env_logprobs = torch.cat([lp[s.from_environment] for lp, s in zip(scored.logprobs, talking)])
    # the loss never reads an environment token: whatever log μ it is given there, the step is the same
    before = {name: p.clone() for name, p in th.flat_params(actor).items()}
    first = actor.train_step(train)
    after = {name: p.clone() for name, p in th.flat_params(actor).items()}
    actor.close()
    other = th.build_actor(model_dir, replay=True, micro_batch_size=8, weights=model_dir, loss="bpo")
    scrambled = [dataclasses.replace(t, rollout_logprobs=torch.where(t.train_mask, t.rollout_logprobs, -3.0))
                 for t in train]
    second = other.train_step(scrambled)
    moved = max(float((p - after[name]).abs().max()) for name, p in th.flat_params(other).items())
    other.close()
    return {"talking": len(talking), "responses": len(samples), "turns": [environment_turns(s) for s in talking],
            "model_tokens": model_gaps.numel(), "env_tokens": env_logprobs.numel(),
            "mean": float(model_gaps.mean()), "max": float(model_gaps.max()),
            "env_logprob_mean": float(env_logprobs.mean()), "loss": (first["loss"], second["loss"]),
            "grad_norm": (first["grad_norm"], second["grad_norm"]), "params_moved_apart": moved,
            "params_moved": max(float((after[n] - before[n]).abs().max()) for n in before)}


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> str:
    return str(tiny_checkpoint(FIXTURE))


@pytest.mark.timeout(300)
def test_the_trainer_scores_model_tokens_as_the_engine_sampled_them_and_trains_on_them_alone(model_dir):
    """Conversations of the embedded engine scored by a Megatron trainer with R3 replaying the
    assembled routing: log π = log μ on every model token, of every turn (fp32); environment
    tokens carry log μ 0, which the loss never reads (a step given −3 there instead is the same
    step, to the bit), while the model tokens do move the weights."""
    from bpo_megatron.parallel.local_world import run_gloo_world

    got = run_gloo_world(_multi_turn_agreement, 1, model_dir, timeout=240)[0]
    print(f"\n[multi-turn agreement] {got['talking']} of {got['responses']} responses called the calculator "
          f"({got['model_tokens']} model tokens, {got['env_tokens']} environment tokens): R3 mean |Δ log μ| = "
          f"{got['mean']:.2e}, max = {got['max']:.2e}")
    assert got["talking"] >= 8 and max(got["turns"]) >= 1 and got["env_tokens"] >= 3 * got["talking"]
    assert got["mean"] <= MEAN_TOLERANCE and got["max"] <= MAX_TOLERANCE, got
    assert got["env_logprob_mean"] < -1.0  # the trainer does score them; only the loss leaves them out
    assert got["loss"][0] == got["loss"][1] and got["grad_norm"][0] == got["grad_norm"][1] > 0, got
    assert got["params_moved_apart"] == 0.0 and got["params_moved"] > 0, got


# ------------------------------------------------------------------ an engine dies mid-talk
class KillingCalculator(Agent):
    """The calculator, which kills engine 1 of ``group`` before answering its first call: the
    conversations' next turn meets a dead engine."""

    call_token = "]"
    reply = "={output};"
    group = None

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.killed = False
        self._calculator = calculator()
        self._lock = threading.Lock()  # conversations are answered from several threads

    def respond(self, prompt, transcript):
        import ray

        with self._lock:
            if not self.killed and self.group is not None:
                self.killed = True
                pid = ray.get(self.group.workers[1].__ray_call__.remote(lambda actor: os.getpid()))
                os.kill(pid, 9)
        return self._calculator.respond(prompt, transcript)


@pytest.mark.timeout(420)
def test_an_engine_that_dies_between_turns_costs_that_turn_only(ray_session, model_dir):
    """Two engines; engine 1 is killed between the first and second turns. The group replaces it
    and sends its share of the second turn again; every conversation keeps its first turn and
    ends as an undisturbed engine would have it (per-turn seeds: the split does not matter)."""
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.orchestration.groups import EngineGroup
    from bpo_megatron.rollout.hf.engine import HFEngine

    requests = _engine_requests()
    reference = Conversations(HFEngine(model_dir, capture_routing=True), calculator(), TOK,
                              max_turns=3).generate(requests)
    cfg = load_experiment(None, [f"model.path={model_dir}", "model.tokenizer=char", "rollout.engine=hf",
                                 "rollout.num_engines=2", "rollout.max_restarts=2", "data.max_prompt_tokens=16",
                                 "rollout.max_new_tokens=14"], check_model=True)
    group = EngineGroup(cfg.engine_group_spec(), model_dir)
    try:
        agent = KillingCalculator(AgentConfig(name=f"{__name__}:KillingCalculator"))
        agent.group = group
        samples = Conversations(group, agent, TOK, max_turns=3).generate(requests)
        assert agent.killed and group.restarts == 1
    finally:
        group.shutdown()
    assert sum(bool(s.from_environment.any()) for s in samples) >= 8
    # the embedded engine recomputes each turn's whole prompt and reports its routing: a later turn's
    # routing of the earlier positions is compared with the replayed one, and agrees (same weights)
    assert sum(s.conversation.later_turns for s in reference) >= 8
    assert sum(s.conversation.recomputed_turns for s in reference + samples) == 0
    # the turns whose engine was replaced went where the load was least (counted as hops); the rest stayed
    assert 1 <= sum(s.conversation.hops for s in samples) < sum(s.conversation.later_turns for s in samples)
    for got, want in zip(samples, reference, strict=True):
        assert (got.request_id, got.index) == (want.request_id, want.index)
        assert torch.equal(got.response_tokens, want.response_tokens), got.request_id
        assert torch.equal(got.from_environment, want.from_environment)
        assert torch.equal(got.routed_experts, want.routed_experts)
        torch.testing.assert_close(got.rollout_logprobs, want.rollout_logprobs, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------- the loop
CALCULATOR_RUN = ("data.train=procedural:mul2", "eval.datasets=[procedural:mul2]",
                  "rollout.agent.name=calculator", "rollout.agent.max_turns=3", "rollout.max_new_tokens=24",
                  "data.max_prompt_tokens=8",
                  # the demo's warm start: the model calls the calculator and is right a quarter of the time
                  "train.sft_warmup_steps=50", "train.sft_batch_size=64", "train.sft_lr=0.003")


def _run(cfg, *, stop_after_step: int | None = None) -> list[str]:
    """The lines the run printed (:func:`loop_helpers.run_loop`)."""
    return run_loop(cfg, stop_after_step=stop_after_step)[1]


def _step(run_dir: Path, step: int) -> dict:
    from bpo_megatron.observability.metrics import read_metrics

    return [r for r in read_metrics(run_dir) if r["step"] == step and "reward_mean" in r][0]


@pytest.mark.slow  # CI time (≈ 200 s): run with -m slow
@pytest.mark.timeout(600)
def test_a_calculator_run_is_killed_and_resumes_its_conversations_as_an_uninterrupted_one(tmp_path, ray_session,
                                                                                           small_run):
    """The loop with rollout.agent: the warm start imitates the calculator's demonstrations, the
    steps train on conversations (most responses call the calculator), evaluation
    talks to it too. A driver killed after step 2's metrics (its checkpoint not yet written)
    resumes from step 1's checkpoint, and its steps 2 and 3 are the uninterrupted run's: the same
    tokens number for number; what μ enters (loss, gradient, |Δ log p|) within fp32 rounding, as
    turns are batched as their answers come (other batch shapes, another summation order)."""
    _run(small_run(tmp_path / "straight", "train.steps=3", *CALCULATOR_RUN))
    with pytest.raises(Interrupted):
        _run(small_run(tmp_path / "killed", "train.steps=3", *CALCULATOR_RUN), stop_after_step=2)
    lines = _run(small_run(tmp_path / "killed", "train.steps=3", *CALCULATOR_RUN))
    assert lines[0].startswith("resumed from step 1")
    for step in (2, 3):
        straight, resumed = _step(tmp_path / "straight", step), _step(tmp_path / "killed", step)
        assert straight["agent/tool_calls_mean"] > 0.5 and straight["agent/env_token_frac"] > 0.1, straight
        assert straight["agent/errors"] == 0 and "eval/mean_avg@2" in straight
        assert straight["zero_std_groups"] < 4 and straight["grad_norm"] > 0, "nothing was learned from"
        for key in ("reward_mean", "agent/tool_calls_mean", "agent/env_token_frac", "response_length_mean",
                    "eval/mean_avg@2"):
            assert resumed[key] == straight[key], (step, key)
        for key in ("loss", "grad_norm", "abs_logp_diff_mean"):
            assert resumed[key] == pytest.approx(straight[key], rel=1e-4, abs=1e-7), (step, key)
    # R3 over the whole sequence: the trainer scores the model's tokens as the engine sampled them
    assert straight["abs_logp_diff_mean"] < 1e-2 and straight["routing_agreement"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_calculator_demo_learns(tmp_path, ray_session):
    """configs/calculator_cpu.yaml as it is: evaluation accuracy over the last two evaluations
    above the first evaluation by 10 points (measured: experiments/multi_turn/README.md)."""
    from bpo_megatron.experiment import load_experiment

    _run(load_experiment(Path(__file__).resolve().parents[1] / "configs" / "calculator_cpu.yaml",
                         [f"logging.run_dir={tmp_path}"]))
    from bpo_megatron.observability.metrics import read_metrics

    evals = [r["eval/mean_avg@4"] for r in read_metrics(tmp_path) if "eval/mean_avg@4" in r]
    assert (evals[-1] + evals[-2]) / 2 > evals[0] + 0.10, evals


def test_the_eval_command_talks_to_the_agent(tiny_checkpoint, monkeypatch, capsys):
    """``bpo-megatron eval`` evaluates as the run does: through conversations with the agent."""
    from bpo_megatron.cli import main
    from bpo_megatron.rollout.agents import conversation

    root = Path(__file__).resolve().parents[1]
    hf_dir = tiny_checkpoint(root / "configs" / "models" / "tiny_qwen3_moe")
    seen = []
    submit = conversation.Conversations.submit

    def recording(self, requests):
        seen.append((type(self.agent).__name__, len(requests), sum(r.sampling.n for r in requests)))
        return submit(self, requests)

    monkeypatch.setattr(conversation.Conversations, "submit", recording)
    code = main(["eval", str(root / "configs" / "calculator_cpu.yaml"), "eval.limit=4", "eval.k=2",
                 "--hf-dir", str(hf_dir)])
    assert code == 0, capsys.readouterr()
    assert seen == [("Calculator", 4, 8)]
    assert "procedural:mul2" in capsys.readouterr().out


@pytest.mark.slow  # two whole runs (CI time): each half runs in the default suite, background evaluation
@pytest.mark.timeout(900)  # in test_background_eval.py, evaluation through the agent in the test above
def test_background_evaluation_talks_to_the_agent_as_inline_evaluation_does(tmp_path, ray_session, small_run):
    """eval.mode=background with the calculator: the evaluation engines hold conversations too
    (each round polled, none waited for), and every evaluation equals the inline run's."""
    from bpo_megatron.observability.metrics import read_metrics

    schedule = (*CALCULATOR_RUN, "train.steps=2", "eval.every=1", "eval.limit=16", "eval.k=2", "checkpoint.every=2")
    evaluations = {}
    for mode in ("inline", "background"):
        _run(small_run(tmp_path / mode, *schedule, f"eval.mode={mode}"))
        evaluations[mode] = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")}
                             for r in read_metrics(tmp_path / mode) if "eval/mean_avg@2" in r}
    assert sorted(evaluations["inline"]) == [0, 1, 2] and evaluations["background"] == evaluations["inline"]
    # right answers come only through the calculator (the model cannot multiply by itself)
    assert all(metrics["eval/mean_avg@2"] > 0.05 for metrics in evaluations["inline"].values()), evaluations
