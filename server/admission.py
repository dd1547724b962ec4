"""Admission: work slots (not sockets) and the bound on open WebSocket sessions.

A slot is held by an HTTP generation request while it runs, and by a WebSocket session only
while it has an utterance or a generation in flight or queued, so idle sessions cannot starve
active clients. Open sessions are bounded separately (`max_open_sessions`). Admission is a
counter, not a queue: over a bound the answer is 429 (or an `overloaded` error event inside a
session) at once, never unbounded waiting.
"""

from __future__ import annotations

from collections import Counter

from aiohttp import web

from server.errors import APIError, overloaded
from server.settings import ServerSettings


class Admission:
    def __init__(self, settings: ServerSettings):
        self.limit = settings.max_concurrent_requests
        self.per_client = settings.max_requests_per_client  # 0: no per-client cap
        self.max_sessions = settings.max_open_sessions
        self.retry_after_s = settings.retry_after_s
        self.active = 0
        self.sessions = 0
        self._by_client: Counter[str] = Counter()

    def try_enter(self, client: str) -> APIError | None:
        """Take a work slot for `client`: None when taken, else the 429 to answer."""
        if self.active >= self.limit:
            return overloaded(self.retry_after_s)
        if self.per_client and self._by_client[client] >= self.per_client:
            return overloaded(
                self.retry_after_s,
                f"This client already has {self.per_client} requests in flight (max_requests_per_client); "
                "retry when one has finished.",
            )
        self.active += 1
        self._by_client[client] += 1
        return None

    def leave(self, client: str) -> None:
        self.active -= 1
        self._by_client[client] -= 1
        if self._by_client[client] <= 0:
            del self._by_client[client]  # the table holds only clients with work in flight

    def try_open_session(self) -> APIError | None:
        if self.sessions >= self.max_sessions:
            return overloaded(self.retry_after_s, f"{self.max_sessions} WebSocket sessions are open "
                                                  "(max_open_sessions); retry later.")
        self.sessions += 1
        return None

    def close_session(self) -> None:
        self.sessions -= 1


class WorkSlot:
    """At most one work slot of one WebSocket session: taken when work starts, given back when
    the session has nothing in flight. Both calls are idempotent."""

    def __init__(self, admission: Admission, client: str):
        self._admission = admission
        self._client = client
        self.held = False

    def acquire(self) -> APIError | None:
        if self.held:
            return None
        refusal = self._admission.try_enter(self._client)
        self.held = refusal is None
        return refusal

    def release(self) -> None:
        if self.held:
            self.held = False
            self._admission.leave(self._client)


ADMISSION: web.AppKey[Admission] = web.AppKey("omnistream_admission", Admission)


def admission_of(request: web.Request) -> Admission:
    return request.app[ADMISSION]


def client_of(request: web.Request) -> str:
    """Who a per-client cap counts against: the peer address (a Unix socket has none)."""
    return request.remote or "local"
