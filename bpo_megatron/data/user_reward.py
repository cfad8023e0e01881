"""``data.reward: package.module:function``: a reward the user writes, run in scoring processes.

The function is called as ``function(record, response)``: ``record`` the problem's dict (``id``,
``problem``, ``answer``, ``source``; :func:`~bpo_megatron.data.reward_values.record_of`),
``response`` the response's text; it returns what
:func:`~bpo_megatron.data.reward_values.read_value` accepts. It must be importable by the driver
and by the scoring worker processes: installed, or its directory on ``PYTHONPATH``.

It runs like math-verify (:class:`~bpo_megatron.data.rewards.MathVerifier`; ``reward_fn`` gives
it as many worker processes and the same timeout, ``SCORING_TIMEOUT_S``): a user's code must not
stall a step any more than a pathological answer may. A call past its timeout scores 0 and its
pool is replaced: its worker would otherwise stay busy with it for good, and the calls queued
behind it are sent to the fresh pool.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Callable

from bpo_megatron.data.reward_values import Outcome, RecordReward, read_value
from bpo_megatron.data.scoring_pool import TimedPool

_SPEC = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
SIGNATURE = "function(record, response)"


def is_function_spec(spec: str) -> bool:
    """``package.module:function``, each part a Python identifier."""
    return bool(_SPEC.match(spec))


def load(spec: str) -> Callable:
    """The function ``spec`` names, or ValueError naming the module or function and the fix."""
    module_name, name = spec.split(":")
    where = f"data.reward={spec!r}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ValueError(f"{where}: module {module_name!r} cannot be imported ({exc}); put the directory holding "
                             "it on PYTHONPATH (the scoring worker processes import it too), or install its "
                             "package") from exc
        raise ValueError(f"{where}: importing module {module_name!r} failed: it imports {missing!r}, which is not "
                         "installed") from exc
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises at import
        raise ValueError(f"{where}: importing module {module_name!r} raised {type(exc).__name__}: {exc}") from exc
    location = getattr(module, "__file__", None) or module_name
    if not hasattr(module, name):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        raise ValueError(f"{where}: module {module_name!r} ({location}) has no function {name!r}; it defines "
                         f"{', '.join(defined) if defined else 'no public function'}")
    function = getattr(module, name)
    if not callable(function):
        raise ValueError(f"{where}: {name!r} in {location} is a {type(function).__name__}, not a function")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins and extension functions have none to read
        return function
    try:
        signature.bind({}, "")
    except TypeError as exc:
        raise ValueError(f"{where}: {name}{signature} cannot be called as {SIGNATURE} ({exc}); a reward takes the "
                         "problem record (a dict: id, problem, answer, source) and the response text") from exc
    return function


# Each worker process imports the function once, on its first call, and keeps it.
_LOADED: dict[str, Callable] = {}


def _score_one(spec: str, record: dict[str, str], response: str) -> Outcome:
    """In a worker process: the function's outcome for one response; never raises."""
    try:
        if spec not in _LOADED:
            _LOADED[spec] = load(spec)
        function = _LOADED[spec]
    except ValueError as exc:
        return Outcome(failure="error", detail=f"could not be loaded in a scoring worker process: {exc}")
    try:
        value = function(record, response)
    except Exception as exc:  # noqa: BLE001 - a user's reward may raise anything; it is counted, not fatal
        return Outcome(failure="error", detail=f"raised {type(exc).__name__}: {exc}")
    return read_value(value)


class FunctionReward(RecordReward):
    """``data.reward: package.module:function``, scored in ``workers`` processes, each call
    within ``timeout_s``. Loading it in this process first refuses a missing module or function
    by name, before a worker process is started."""

    def __init__(self, spec: str, *, workers: int, timeout_s: float, batch_timeout_s: float | None = None) -> None:
        super().__init__(spec)
        load(spec)
        if workers < 1:
            raise ValueError(f"a user reward needs at least 1 worker process, got workers={workers}")
        self.workers, self.timeout_s, self.batch_timeout_s = workers, timeout_s, batch_timeout_s
        self._pool = TimedPool(workers, timeout_s)

    def outcomes(self, records: list[dict[str, str]], responses: list[str]) -> list[Outcome]:
        results = self._pool.run(_score_one, [(self.spec, record, response)
                                              for record, response in zip(records, responses)],
                                 deadline_s=self.batch_timeout_s)
        return [result.value if result.ok else Outcome(failure="error", detail=self._failure(result))
                for result in results]

    def _failure(self, result) -> str:
        if result.past_deadline:
            return f"was not scored within the batch's {self.batch_timeout_s:g} s (data.reward_batch_timeout_s)"
        if result.timed_out:
            return f"did not return within {self.timeout_s:g} s (the scoring timeout)"
        return f"failed in a scoring worker process: {result.error}"

    def close(self) -> None:
        self._pool.close()
