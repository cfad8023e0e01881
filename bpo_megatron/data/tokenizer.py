"""Tokenizers behind one small interface: a Hugging Face tokenizer directory, or characters."""

from __future__ import annotations

import string
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    end_of_turn_ids: tuple[int, ...]  # what ends an assistant turn of the chat template, if any

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def render_prompt(self, problem: str, template: str) -> str: ...


class CharTokenizer:
    """One token per printable ASCII character, after <pad> (0) and <eos> (1). 97 tokens."""

    specials = ("<pad>", "<eos>")

    def __init__(self) -> None:
        self._chars = string.printable[:95]  # digits, letters, punctuation, space
        self._ids = {c: i + len(self.specials) for i, c in enumerate(self._chars)}
        self.vocab_size = len(self.specials) + len(self._chars)
        self.eos_token_ids = (1,)
        self.end_of_turn_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the character tokenizer") from exc

    def decode(self, ids: list[int]) -> str:
        """Specials vanish; ids past the alphabet (a model's padded vocabulary) read as U+FFFD."""
        n = len(self.specials)
        return "".join(self._chars[i - n] if i - n < len(self._chars) else "\ufffd" for i in ids if i >= n)

    def render_prompt(self, problem: str, template: str) -> str:
        return f"{problem}="  # procedural tasks: "12+7=" → "19<eos>"


class HFTokenizer:
    """A local Hugging Face tokenizer (no hub access); prompts go through its chat template."""

    def __init__(self, directory: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(directory)
        self.vocab_size = len(self._tok)
        eos = {self._tok.eos_token_id} if self._tok.eos_token_id is not None else set()
        self.eos_token_ids = tuple(sorted(eos))
        self.end_of_turn_ids = _end_of_turn_ids(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def render_prompt(self, problem: str, template: str) -> str:
        content = TEMPLATES[template].format(problem=problem)
        if self._tok.chat_template:
            return self._tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
        return content


_SENTINEL = "bpo-megatron-end-of-turn-probe"


def _end_of_turn_ids(tok) -> tuple[int, ...]:
    """The token the chat template closes an assistant turn with (Qwen's ``<|im_end|>``, Llama 3's
    ``<|eot_id|>``), found by rendering one turn: prompts go through the chat template, so a
    response ends there, and a base model's end-of-sequence token (Qwen3-Base: ``<|endoftext|>``)
    is often another token. () without a chat template, or when what follows the turn is not one
    added token (a template that cannot render a turn, or closes it with ordinary text)."""
    if not tok.chat_template:
        return ()
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "1+1"},
                                        {"role": "assistant", "content": _SENTINEL}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template's own error: it renders no turn to read from
        return ()
    after = text.rsplit(_SENTINEL, 1)[1] if _SENTINEL in text else ""
    ids = tok.encode(after, add_special_tokens=False) if after else []
    return (ids[0],) if ids and ids[0] in tok.added_tokens_decoder else ()


TEMPLATES = {
    "math-boxed": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    # DAPO-Math-17k's own instruction: the final answer on a line of its own after "Answer:".
    "math-answer-line": ("Solve the following math problem step by step. The last line of your response should be "
                         "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
                         "\n\n{problem}\n\nRemember to put your answer on its own line after \"Answer:\"."),
    "plain": "{problem}",
}


def load_tokenizer(spec: str) -> Tokenizer:
    return CharTokenizer() if spec == "char" else HFTokenizer(spec)
