"""Many speech contexts on one WebSocket (ElevenLabs' multi-stream-input, Cartesia's
`context_id`s): each context has its own Speaker (ordered segments, prefetch), and they share
the session's one work slot.

The session's slot (server.ws_common.SessionActivity) is taken when the first context starts
work and given back when the last one ends, so a socket with several busy contexts still
counts as one session's work for admission, and an idle socket holds none.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from server.context import ServerContext
from server.errors import APIError
from server.tts.speaker import Speaker, Work
from server.ws_common import (
    BadMessage,
    CloseRequest,
    SessionActivity,
    bad_message,
    dispatch_text,
    read_message,
    send_json,
)
from streaming.schema import SchemaError

# ElevenLabs allows five concurrent contexts per multi-stream socket; the same bound keeps a
# Cartesia socket's prefetch (contexts x ws_max_inflight_utterances) small.
MAX_CONTEXTS = 5


@dataclass(frozen=True)
class ContextLimits:
    max_contexts: int = MAX_CONTEXTS
    # How often idle contexts are looked for (their timeout is the socket's inactivity_timeout).
    sweep_interval_s: float = 1.0


class SharedWork:
    """The session's slot held while any context works."""

    def __init__(self, session: Work):
        self._session = session
        self._holders = 0

    def acquire(self) -> APIError | None:
        if self._holders == 0:
            refused = self._session.start_work()
            if refused is not None:
                return refused
        self._holders += 1
        return None

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self._session.end_work()


class ContextWork:
    """One context's share (the `Work` its Speaker is given): takes and gives back once."""

    def __init__(self, shared: SharedWork):
        self._shared = shared
        self.held = False

    def start_work(self) -> APIError | None:
        if self.held:
            return None
        refused = self._shared.acquire()
        self.held = refused is None
        return refused

    def end_work(self) -> None:
        if self.held:
            self.held = False
            self._shared.release()


class SpeakingContext(Protocol):
    speaker: Speaker


class ContextSocket(ABC):
    """What the multi-context sockets (ElevenLabs, Cartesia) share: the contexts and their shared
    work slot, the session loop that stops every context's Speaker when the socket ends, and the
    reading of a text message whose mistakes are answered as the protocol's error event.

    A protocol implements the abstract methods: its error event, and how it reads a message."""

    def __init__(self, ctx: ServerContext, ws: web.WebSocketResponse, activity: SessionActivity, endpoint: str,
                 limits: ContextLimits):
        self.ctx = ctx
        self.ws = ws
        self.activity = activity
        self.endpoint = endpoint
        self.limits = limits
        self.shared_work = SharedWork(activity)
        self.closer = CloseRequest()
        self.contexts: dict[str, SpeakingContext] = {}

    async def send(self, event: dict) -> None:
        if not self.ws.closed:
            await send_json(self.ws, event)

    @abstractmethod
    async def send_error(self, code: str, message: str, param: str | None, context_id: str | None = None) -> None:
        """The protocol's error event."""

    def _side_task(self) -> asyncio.Task | None:
        """A task that runs beside the reader for the socket's life (None: none)."""
        return None

    async def run(self) -> None:
        self.ctx.metrics.active_streams.labels(self.endpoint).inc()
        side = self._side_task()
        try:
            await dispatch_text(self.ws, self.activity, self.closer, self.endpoint, self._on_text, self._on_binary)
        finally:
            if side is not None:
                side.cancel()
            # Every context is stopped before the first await: this finally may itself be
            # cancelled (a server with handler_cancellation), which would skip the rest.
            stopped = [task for c in self.contexts.values() for task in c.speaker.stop()]
            self.ctx.metrics.active_streams.labels(self.endpoint).dec()
            await asyncio.gather(*stopped, return_exceptions=True)

    @abstractmethod
    async def _on_binary(self) -> None:
        """A binary frame arrived (the protocols speak JSON text)."""

    @abstractmethod
    def _context_id(self, obj: dict) -> str | None:
        """The context an error about this message names (None: the socket's)."""

    @abstractmethod
    async def _on_object(self, obj: dict) -> None:
        """One decoded message (raise SchemaError, APIError or BadMessage to refuse it)."""

    async def _on_text(self, data: str) -> None:
        context_id: str | None = None
        try:
            obj = read_message(data, self.ctx.settings)
            context_id = self._context_id(obj)
            await self._on_object(obj)
        except SchemaError as e:
            await self._reject(bad_message(e), context_id)
        except APIError as e:
            await self._reject(BadMessage("invalid_field", e.message, e.param), context_id)
        except BadMessage as e:
            await self._reject(e, context_id)

    async def _reject(self, e: BadMessage, context_id: str | None) -> None:
        await self.send_error(e.code, e.message, e.param, context_id)
        if e.close is not None and not self.ws.closed:
            await self.ws.close(code=e.close, message=e.code.encode())
