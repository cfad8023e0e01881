"""Tokenizers behind one small interface: a Hugging Face tokenizer directory, or characters."""

from __future__ import annotations

import string
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

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


TEMPLATES = {
    "math-boxed": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "plain": "{problem}",
}


def load_tokenizer(spec: str) -> Tokenizer:
    return CharTokenizer() if spec == "char" else HFTokenizer(spec)
