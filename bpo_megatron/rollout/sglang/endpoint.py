"""Where one SGLang server is reached, and with which key: what the trainer's weight transports
are handed (never the engine group itself)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bpo_megatron.rollout.sglang.http import request_json


@dataclass(frozen=True)
class ServerEndpoint:
    """``url``: the server's base URL on its node's address (reachable from other nodes);
    ``tp_size``: its tensor-parallel ranks; ``api_key``: the secret it was started with (None for
    a server attached by URL without one). The key never appears in ``repr`` or messages."""

    url: str
    tp_size: int
    api_key: str | None = field(default=None, repr=False)

    def post(self, route: str, body: Any, *, timeout: float) -> Any:
        return request_json("POST", f"{self.url}/{route}", body, timeout=timeout, api_key=self.api_key)

    def get(self, route: str, *, timeout: float) -> Any:
        return request_json("GET", f"{self.url}/{route}", timeout=timeout, api_key=self.api_key)
