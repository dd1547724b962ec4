"""What the HTTP/WebSocket front end needs from an engine: one Protocol and its two errors.

The real implementation is `server.engine_client` (ZeroMQ to the engine process); tests use
`tests.support.fake_engine.FakeEngine`. Handlers depend on this Protocol only, so either can be
plugged into `server.app.build_app`.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

import numpy as np

from streaming.ipc import AddRequest, EngineStats, Ready, RequestOutput


class EngineOverloaded(Exception):
    """The engine cannot admit another request now (answered with 429 / WS `overloaded`)."""

    def __init__(self, message: str = "engine is at capacity", retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailable(Exception):
    """The engine process is dead or unreachable (answered with 503 / WS `engine_unavailable`)."""


class EngineClientProtocol(Protocol):
    info: Ready

    @property
    def healthy(self) -> bool: ...

    def generate(self, req: AddRequest) -> AsyncIterator[RequestOutput]:
        """Per-step outputs of one request; the last one has `finished=True`.

        Raises EngineOverloaded / EngineUnavailable (at the first iteration at the latest).
        Consumers wrap the iterator in `contextlib.aclosing`: when they stop iterating
        (break, cancel, client disconnect) the client aborts the request in the engine.
        """
        ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> EngineStats: ...

    async def encode_audio(self, pcm: bytes) -> np.ndarray:
        """A reference clip (s16le mono at the codec's rate) -> its codes [frames, K]."""
        ...
