"""The calculator: the model writes an arithmetic expression between ``[`` and the call token
``]``; the agent answers with its value (``[37*58]`` → ``=2146;``). Integers and + − × / // %
and powers, evaluated from the syntax tree (never ``eval``), with bounded sizes."""

from __future__ import annotations

import ast
import operator

from bpo_megatron.rollout.agents.base import Agent, Turn

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 30  # operands and results beyond this are an error, not a long computation
MAX_EXPONENT = 64
OPEN = "["
ERROR = "error"


class Calculator(Agent):
    call_token = "]"
    reply = "={output};"

    def respond(self, prompt: str, transcript: list[Turn]) -> str:
        return self.format_reply(calculate(self.call_of(transcript, OPEN)))

    def demonstration(self, problem: str, answer: str) -> list[Turn]:
        return [Turn(f"{OPEN}{problem}{self.call_token}"), Turn(self.format_reply(calculate(problem)), True),
                Turn(answer)]


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text (an integer's digits; a fraction to 6
    places), or ``error``."""
    try:
        value = _value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ArithmeticError, RecursionError):
        return ERROR
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.6f}".rstrip("0")
    return str(value)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in SIGNS:
        return SIGNS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError("exponent too large")
        return _bounded(OPERATORS[type(node.op)](left, right))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex) or abs(value) >= 10 ** MAX_DIGITS:
        raise ValueError("number too large")
    return value
