"""A small JSON-over-HTTP client (stdlib only) that tells apart the failures we handle differently."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any


class ServerUnavailable(ConnectionError):
    """Nothing answers at the address (the server died or has not started)."""


class RequestTimeout(TimeoutError):
    """The server accepted the request but did not answer in time."""


class ServerError(RuntimeError):
    """The server answered with an error; ``retryable`` for 5xx."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def request_json(method: str, url: str, body: Any = None, *, timeout: float, api_key: str | None = None) -> Any:
    """``api_key``: the server's ``--api-key`` (SGLang refuses every call but its health probes
    without it), sent as a bearer token."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise ServerError(f"{method} {url} -> HTTP {exc.code}: {detail}", retryable=exc.code >= 500) from exc
    except (TimeoutError, socket.timeout) as exc:
        raise RequestTimeout(f"{method} {url} gave no answer within {timeout:.0f}s") from exc
    # A server that dies mid-response closes the connection without a status line.
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise RequestTimeout(f"{method} {url} gave no answer within {timeout:.0f}s") from exc
        raise ServerUnavailable(f"{method} {url}: {reason}") from exc
    if not payload:
        return None
    try:
        return json.loads(payload)
    except json.JSONDecodeError:
        return payload.decode(errors="replace")

