"""``data.reward: http://host:port/path``: rewards from a service, one POST per scoring call.

The schema (JSON both ways, ``Content-Type: application/json``):

* request body: a list with one object per response to score, in order,
  ``[{"id": "q7", "problem": "...", "answer": "...", "source": "...", "response": "..."}, ...]``
  (the problem's record, :func:`~bpo_megatron.data.reward_values.record_of`, and the response's
  text);
* response body: a list of the same length, in the same order, each entry a score (a number in
  [-1, 1]), an object ``{"score": 0.5, "<name>": <number>, ...}`` (extras logged as
  ``reward/<name>``), or ``{"error": "why"}`` for a response the service could not score.

An entry that is invalid (:func:`~bpo_megatron.data.reward_values.read_value`) or an error scores
0 and is counted, like a user function's. A call that fails as a whole — no connection, no answer
within ``data.reward_timeout_s``, an HTTP 5xx — is tried again, ``data.reward_retries`` times
after the first, waiting 0.5 s, 1 s, 2 s... in between; when every attempt fails, or the service
answers something that is not such a list (an HTTP 4xx, not JSON, another length), the call
raises :class:`ServiceError`: a whole batch scored 0 would train on nothing but noise, so the run
stops (and resumes from its last checkpoint once the service is back).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from bpo_megatron.data.reward_values import Outcome, RecordReward, RewardFailed, read_value

RETRY_BACKOFF_S = 0.5  # the wait before the first retry, doubled before each further one
# The defaults of data.reward_timeout_s and data.reward_retries: a batch of a few thousand
# responses may take a service a while; a restart of it, a few seconds.
TIMEOUT_S = 60.0
RETRIES = 2


class ServiceError(RewardFailed):
    """The reward service could not score a batch; the message names the URL, the batch's first
    record and what failed."""


def is_url(spec: str) -> bool:
    parts = urlsplit(spec)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


class RewardService(RecordReward):
    def __init__(self, url: str, *, timeout_s: float = TIMEOUT_S, retries: int = RETRIES) -> None:
        super().__init__(url)
        self.url, self.timeout_s, self.retries = url, timeout_s, retries

    def outcomes(self, records: list[dict[str, str]], responses: list[str]) -> list[Outcome]:
        if not records:
            return []
        batch = f"{len(records)} responses (the first of record {records[0]['id']!r})"
        entries = self._post([{**record, "response": response} for record, response in zip(records, responses)],
                             batch)
        if not isinstance(entries, list) or len(entries) != len(records):
            got = f"a list of {len(entries)}" if isinstance(entries, list) else f"a {type(entries).__name__}"
            raise ServiceError(f"data.reward={self.url}: the service answered {got} for {batch}; it must answer a "
                               "JSON list with one entry per response, in order")
        return [self._outcome(entry) for entry in entries]

    @staticmethod
    def _outcome(entry: Any) -> Outcome:
        if isinstance(entry, dict) and entry.get("error") is not None:
            return Outcome(failure="error", detail=f"could not be scored by the service: {entry['error']}")
        return read_value(entry)

    def _post(self, items: list[dict[str, str]], batch: str) -> Any:
        request = urllib.request.Request(self.url, data=json.dumps(items).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        failure = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    body = reply.read()
            except urllib.error.HTTPError as exc:
                failure = f"HTTP {exc.code} {exc.reason}: {exc.read()[:300].decode(errors='replace')}".rstrip(": ")
                if exc.code < 500:  # the request itself is refused: sending it again changes nothing
                    raise ServiceError(f"data.reward={self.url}: the service refused {batch}: {failure}") from exc
            except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                failure = f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
            else:
                try:
                    return json.loads(body)
                except ValueError as exc:
                    raise ServiceError(f"data.reward={self.url}: the service answered {batch} with what is not JSON: "
                                       f"{body[:200]!r}") from exc
        raise ServiceError(f"data.reward={self.url}: the reward service failed {self.retries + 1} time(s) scoring "
                           f"{batch} (last: {failure}); check that it runs at that URL and answers within "
                           f"data.reward_timeout_s={self.timeout_s:g} s, or allow more attempts "
                           f"(data.reward_retries={self.retries})")
