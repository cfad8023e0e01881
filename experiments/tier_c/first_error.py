"""Where the base's wrong scratchpads first go wrong (experiments/tier_c/README.md, "Why").

Generates the RL runs' step-0 evaluation of the committed base (``rl.yaml``'s evaluation: Avg@4 on
its 250 questions of ``procedural:addpad56``, sampled with the engine, requests and seeds a run of
``--seed`` uses: ``bpo-megatron compare`` sets ``seed`` and ``rollout.seed`` to the run's seed, and
an evaluation's requests are seeded ``seed + 7 * step + dataset index``), then, for every response
the run's reward scores wrong, finds the first character where it departs from the question's
correct scratchpad (:func:`bpo_megatron.data.procedural.scratchpad_sum`) and says what the correct
scratchpad has there. Prints a markdown table (``experiments/tier_c/base/first_error.md``)::

    nice -n 10 .venv/bin/python experiments/tier_c/first_error.py --seed 1 > experiments/tier_c/base/first_error.md

Classes of the first departure, by the correct scratchpad's character at that position:

* ``operand digit``: a digit of a column's ``a+b`` terms, the operands' digits copied from the
  prompt (0 where the shorter operand has none);
* ``carry-in``: the column's carry-in term ``+1``, written where there is none or left out where
  there is one (a ``+`` written where the correct ``=`` follows ``a+b``, or the reverse);
* ``column sum digit``: a digit of the column's sum after its ``=``;
* ``carry digit``: the digit after ``c``;
* ``final answer``: after the last ``=``, everything before it right;
* ``missing/extra column``: the answer's ``=`` begun where a column is due, or a column begun
  where the answer's ``=`` is due;
* ``structural``: any other ``+``, ``=``, ``c`` or ``;``;
* ``truncated before departing``: cut off by the length limit with everything written right.

A field written too long or too short departs at its end: a digit where the correct scratchpad has
the delimiter after a field counts for that field, as does a delimiter or the end of the response
where it has one of the field's digits.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OPERAND, CARRY_IN, SUM, CARRY, FINAL = "operand digit", "carry-in", "column sum digit", "carry digit", "final answer"
COLUMN, STRUCTURAL, TRUNCATED = "missing/extra column", "structural", "truncated before departing"
CLASSES = (OPERAND, CARRY_IN, SUM, CARRY, FINAL, COLUMN, STRUCTURAL, TRUNCATED)
END = "<end>"  # the response's end, where it stopped (end-of-sequence) before the correct scratchpad did


def labelled(scratchpad: str) -> list[tuple[str, str]]:
    """Each character of a correct scratchpad (``7+5=12c1;1+6+1=8c0;=78``) with its role: its
    field's class for a digit; for a delimiter, what it is: ``+carry-in`` (the ``+`` before a
    carry-in), ``=terms-end`` (the ``=`` right after ``a+b``, no carry-in), ``;column-end``,
    ``=final`` (the answer's ``=``), ``delimiter`` (any other ``+``, ``=``, ``c``)."""
    *columns, answer = scratchpad.split(";")
    if not answer.startswith("=") or not answer[1:].isdigit():
        raise ValueError(f"not a scratchpad (no answer after the last ';'): {scratchpad!r}")
    out: list[tuple[str, str]] = []
    for column in columns:
        terms, _, rest = column.partition("=")
        total, _, carry = rest.partition("c")
        parts = terms.split("+")
        if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts) or not (total + carry).isdigit():
            raise ValueError(f"not a scratchpad column: {column!r} of {scratchpad!r}")
        for index, part in enumerate(parts):
            if index:
                out.append(("+", "+carry-in" if index == 2 else "delimiter"))
            out.extend((d, CARRY_IN if index == 2 else OPERAND) for d in part)
        out.append(("=", "=terms-end" if len(parts) == 2 else "delimiter"))
        out.extend((d, SUM) for d in total)
        out.append(("c", "delimiter"))
        out.extend((d, CARRY) for d in carry)
        out.append((";", ";column-end"))
    out.append(("=", "=final"))
    out.extend((d, FINAL) for d in answer[1:])
    return out


def column_of(scratchpad: str, position: int) -> str:
    """Which part of ``scratchpad`` holds ``position``: its column's number (1: the least
    significant), or ``answer`` from the answer's ``=`` on."""
    columns = scratchpad.count(";")
    column = scratchpad[:position].count(";") + 1
    return str(column) if column <= columns else "answer"


FIELDS = (OPERAND, CARRY_IN, SUM, CARRY, FINAL)


def classify(response: str, scratchpad: str, *, cut_off: bool) -> tuple[str, int]:
    """The class of ``response``'s first departure from ``scratchpad`` and its position.
    ``cut_off``: the response ended at the length limit. A response equal to the scratchpad has no
    departure (ValueError: the reward scores it right)."""
    reference = labelled(scratchpad) + [(END, "end")]
    written = list(response) + [END]
    position = next((i for i, (wrote, (due, _)) in enumerate(zip(written, reference)) if wrote != due), None)
    if position is None:
        raise ValueError(f"the response is the correct scratchpad: {response!r}")
    wrote, (_, role) = written[position], reference[position]
    previous = reference[position - 1][1] if position else ";column-end"
    if wrote == END and cut_off:
        return TRUNCATED, position
    if role in FIELDS:  # one of a field's digits is due
        if wrote == "=" and previous == ";column-end":
            return COLUMN, position  # the answer begun where a column is due
        return role, position
    # a delimiter, or the scratchpad's end, is due
    if wrote.isdigit() and previous in FIELDS:
        return previous, position  # the field before it written too long
    if role == "+carry-in" and wrote == "=":
        return CARRY_IN, position  # the carry-in left out
    if role == "=terms-end" and wrote == "+":
        return CARRY_IN, position  # a carry-in where there is none
    if role == "=final" and wrote.isdigit():
        return COLUMN, position  # a column begun where the answer is due
    return STRUCTURAL, position


def base_evaluation_note(dataset: str, cfg) -> str:
    """Why the base's own evaluation of ``dataset`` (``base/stage2_metrics.jsonl``, step 0) reads
    otherwise: other questions and other sampling seeds, from its recorded config."""
    import json

    import yaml

    base = Path(__file__).resolve().parent / "base"
    stage2 = yaml.safe_load((base / "stage2_config.yaml").read_text())
    index = stage2["eval"]["datasets"].index(dataset)
    key = f"eval/{dataset}_avg@{stage2['eval']['k']}"
    step0 = next(r for r in map(json.loads, (base / "stage2_metrics.jsonl").read_text().splitlines())
                 if r["step"] == 0 and key in r)
    return (f"The base's own evaluation of `{dataset}` after its second stage (`base/stage2_metrics.jsonl`, step 0: "
            f"{100 * step0[key]:.1f}%) is another sample: its "
            f"{stage2['eval']['limit']} questions are drawn with seed {10_000 + index} (the set's index {index} among "
            f"its evaluation sets, `load_eval_sets`) and sampled with seed {stage2['seed'] + index} (its `seed` "
            f"{stage2['seed']} + that index); the runs' step-0 evaluations share {cfg.eval.limit} questions drawn "
            f"with seed 10000 and are sampled with their run's seed.\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/tier_c/rl.yaml")
    parser.add_argument("--seed", type=int, default=1, help="the run's seed whose step-0 evaluation is regenerated")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    from bpo_megatron.commands.evaluate import _prepare
    from bpo_megatron.data.rewards import reward_fn
    from bpo_megatron.eval.avg_at_k import eval_requests, score_evaluation
    from bpo_megatron.experiment import load_experiment
    from bpo_megatron.rollout.agents import with_agent
    from bpo_megatron.rollout.engine import EngineContext
    from bpo_megatron.tasks.scoring import response_texts, score, truncated

    # what `bpo-megatron compare --seeds <seed>` sets for a run of that seed
    cfg = load_experiment(args.config, [f"seed={args.seed}", f"rollout.seed={args.seed}"])
    # the pretrained base named by model.path (not a checkpoint of a run that may lie in its run directory)
    sets, tokenizer, (_, model_dir), agent = _prepare(cfg, argparse.Namespace(hf_dir=cfg.model.path, checkpoint=None))
    engine = cfg.rollout.spec.build(cfg.rollout.options,
                                    EngineContext(model_dir=model_dir, index=0, routing=None, threads=args.threads))
    try:
        generated = with_agent(engine, agent, tokenizer).generate(eval_requests(sets, tokenizer, cfg, step=0))
    finally:
        engine.shutdown()
    reward = reward_fn(cfg.data.reward, cfg.data)
    result = score_evaluation(generated, sets, tokenizer, reward, cfg, step=0)

    (eval_set,) = sets
    problems = [e.problem for e in eval_set.prompts for _ in range(cfg.eval.k)]
    # scored as score_evaluation scores them: a truncated response is wrong
    correct = (score(generated, problems, tokenizer, reward, truncated_reward=0.0) == 1.0).tolist()
    if sum(correct) != result.counts[eval_set.name][0]:
        raise AssertionError("the per-response scores disagree with the evaluation's count")
    texts = response_texts(generated, tokenizer)
    tally: Counter[str] = Counter()
    stopped: Counter[str] = Counter()  # of each class, the responses that ended (end-of-sequence) at the departure
    by_column: Counter[str] = Counter()
    examples: dict[str, tuple[str, str, int]] = {}
    for sample, problem, text, right in zip(generated, problems, texts, correct):
        if right:
            continue
        kind, position = classify(text, problem.answer, cut_off=truncated(sample))
        tally[kind] += 1
        stopped[kind] += position == len(text) and kind != TRUNCATED
        by_column[column_of(problem.answer, position)] += 1
        examples.setdefault(kind, (problem.answer, text, position))

    wrong, total = len(correct) - sum(correct), len(correct)
    avg = 100 * result.scores[eval_set.name]
    print(f"# Where the base's wrong scratchpads first go wrong\n")
    print(f"`nice -n 10 .venv/bin/python experiments/tier_c/first_error.py --seed {args.seed}`: the committed base "
          f"(`{cfg.model.path}/`) on `{args.config}`'s evaluation ({len(eval_set.prompts)} questions of "
          f"`{eval_set.name}`, Avg@{cfg.eval.k}, temperature {cfg.eval.temperature:g}), sampled as the step-0 "
          f"evaluation of the runs of seed {args.seed} (requests seeded {cfg.seed + 0 * 7 + 0}).\n")
    halves = result.halves[eval_set.name]
    print(f"Avg@{cfg.eval.k} = {avg:.1f}% ({sum(correct)} of {total} responses right; questions at even positions "
          f"{halves['even'][0]} of {halves['even'][1]}, odd {halves['odd'][0]} of {halves['odd'][1]}: the columns "
          f"`correct`, `even_correct`, `odd_correct` of step 0 in the runs' `runs_s{args.seed}.csv`); "
          f"{wrong} of {total} responses scored wrong, each classified by its first departure from the "
          "question's correct scratchpad (the classes: this script's docstring).\n")
    print(base_evaluation_note(eval_set.name, cfg))
    print("| first departure | responses | share of wrong | of them, ended there |")
    print("|---|---:|---:|---:|")
    for kind in CLASSES:
        print(f"| {kind} | {tally[kind]} | {100 * tally[kind] / wrong:.1f}% | {stopped[kind]} |")
    print(f"| all wrong | {wrong} | 100.0% | {sum(stopped.values())} |\n")
    print("(*ended there*: the response stopped, end-of-sequence, where the correct scratchpad goes on.)\n")
    print("The column (least significant first) whose characters hold the first departure:\n")
    print("| column | responses | share of wrong |")
    print("|---|---:|---:|")
    for column in sorted(by_column, key=lambda c: (not c.isdigit(), int(c) if c.isdigit() else 0)):
        print(f"| {column} | {by_column[column]} | {100 * by_column[column] / wrong:.1f}% |")
    print()
    print("One example of each class (correct scratchpad, response, position of the first departure):\n")
    for kind in CLASSES:
        if kind in examples:
            answer, text, position = examples[kind]
            print(f"* {kind}: `{answer}` / `{text}` at {position} "
                  f"(`{answer[position:position + 1] or END}` due, `{text[position:position + 1] or END}` written)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
