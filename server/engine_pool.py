"""Data parallel: several engines behind one front end (`serve --data-parallel-size N` or
`--devices`).

EnginePool is itself an EngineClientProtocol, so the handlers, the speakers and the ZeroMQ
gateway do not know how many engines serve them; with one engine it is a thin pass-through.

Routing: a request goes to the healthy engine with the fewest requests in flight (counted
here, from routing to the end of the request's stream); ties go to the engine after the one
picked last, so an idle pool alternates. A request's abort, and the abort that closing its
stream sends, go to the engine that holds it (the member's own stream does it).

A WebSocket session keeps one engine for all its utterances (`session_affinity()` around its
handler): its prompts share the voice template, which that engine's prefix cache then holds.
When the session's engine is unhealthy its next utterance is routed afresh and stays there.

Engine death: each member (server.engine_client.EngineClient) fails only its own requests at
once (EngineUnavailable: 503 / an error event / a ZeroMQ error) and restarts itself; the pool
routes new work away from it until it reports healthy again, and is healthy while any member is.
"""

from __future__ import annotations

import numpy as np

import asyncio
import contextlib
from contextlib import aclosing
from contextvars import ContextVar
from typing import AsyncIterator, Iterator, Protocol, Sequence

import msgspec

from server.engine_api import EngineClientProtocol, EngineUnavailable
from streaming.ipc import AddRequest, EngineStats, Ready, RequestOutput
from streaming.sampling_params import InvalidRequest


class PoolMember(EngineClientProtocol, Protocol):
    """An engine of the pool: the engine API plus what /health and /metrics show of it."""

    device: str
    restarts: int

    @property
    def pid(self) -> int | None: ...


class EngineStatus(msgspec.Struct):
    """One engine as /health lists it and /metrics labels it."""

    engine: int  # index in the pool: the `engine` label
    healthy: bool
    device: str
    pid: int | None  # the engine process (None where there is none, e.g. an in-process fake)
    in_flight: int  # requests routed to it whose streams are open
    restarts: int


class _Affinity:
    """The engine one session's requests go to (mutable: the session's tasks share it)."""

    __slots__ = ("pool", "index")

    def __init__(self) -> None:
        self.pool: EnginePool | None = None
        self.index = -1


# Set around a WebSocket session's handler; the tasks the session starts copy the context and
# so share the one _Affinity object.
_AFFINITY: ContextVar[_Affinity | None] = ContextVar("omnistream_engine_affinity", default=None)


@contextlib.contextmanager
def session_affinity() -> Iterator[None]:
    """Requests made inside (and in tasks started inside) go to one engine while it is healthy."""
    token = _AFFINITY.set(_Affinity())
    try:
        yield
    finally:
        _AFFINITY.reset(token)


def sum_stats(parts: list[EngineStats]) -> EngineStats:
    """The pool's counters: every engine's summed, their active request ids together."""
    total = {f: sum(getattr(s, f) for s in parts) for f in EngineStats.__struct_fields__ if f != "active_request_ids"}
    return EngineStats(**total, active_request_ids=sorted(r for s in parts for r in s.active_request_ids))


class EnginePool:
    def __init__(self, engines: Sequence[PoolMember]):
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self._in_flight = [0] * len(self.engines)
        self._owner: dict[str, int] = {}  # request id -> index of the engine holding it
        self._next = 0  # where the tie-break starts

    @classmethod
    def of(cls, engine: EngineClientProtocol) -> EnginePool:
        """`engine` itself when it is a pool, else a pool of that one engine."""
        return engine if isinstance(engine, EnginePool) else cls([engine])

    # ---- lifecycle (members that are EngineClients) ------------------------------------------------

    async def start(self) -> None:
        """Start every engine at once. The first that fails cancels the others' start (an engine
        still loading would otherwise hold up the error for minutes); all are stopped and its
        error is raised."""
        try:
            async with asyncio.TaskGroup() as tg:
                for e in self.engines:
                    tg.create_task(e.start())
        except BaseExceptionGroup as group:
            await self.close()
            raise group.exceptions[0] from None

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))

    # ---- EngineClientProtocol --------------------------------------------------------------------------

    @property
    def info(self) -> Ready:
        return self.engines[0].info  # every member serves the same model folder

    @property
    def healthy(self) -> bool:
        return any(e.healthy for e in self.engines)

    def _pick(self) -> int:
        affinity = _AFFINITY.get()
        if affinity is not None and affinity.pool is self and self.engines[affinity.index].healthy:
            return affinity.index
        n = len(self.engines)
        best = -1
        for k in range(n):
            i = (self._next + k) % n
            if self.engines[i].healthy and (best < 0 or self._in_flight[i] < self._in_flight[best]):
                best = i
        if best < 0:
            raise EngineUnavailable(f"no engine is running (all {n} are down or restarting)" if n > 1
                                    else "engine is not running")
        self._next = (best + 1) % n
        if affinity is not None:
            affinity.pool, affinity.index = self, best
        return best

    async def generate(self, req: AddRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs from the engine it is routed to (see the module doc)."""
        if req.request_id in self._owner:
            raise InvalidRequest("request_id", f"{req.request_id!r} is already in use")
        i = self._pick()
        self._in_flight[i] += 1
        self._owner[req.request_id] = i
        try:
            async with aclosing(self.engines[i].generate(req)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            self._in_flight[i] -= 1
            del self._owner[req.request_id]

    async def append_text(self, request_id: str, step_text_ids: list[int], final: bool) -> None:
        """More text of a running request, to the engine that runs it."""
        i = self._owner.get(request_id)
        if i is not None:
            await self.engines[i].append_text(request_id, step_text_ids, final)

    async def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:  # an unknown id has no stream left to free
            await self.engines[i].abort(request_id)

    async def encode_audio(self, pcm: bytes) -> tuple[np.ndarray, np.ndarray | None]:
        """A reference clip's codes (and speaker vector) from the least loaded healthy engine
        (every engine holds the same codec)."""
        return await self.engines[self._pick()].encode_audio(pcm)

    async def stats(self) -> EngineStats:
        """The healthy engines' counters summed; EngineUnavailable when none answers."""
        parts = [s for _, s in await self.engine_stats() if s is not None]
        if not parts:
            raise EngineUnavailable("no engine is running")
        return sum_stats(parts)

    # ---- per engine ------------------------------------------------------------------------------------

    def statuses(self) -> list[EngineStatus]:
        return [EngineStatus(i, e.healthy, e.device, e.pid, self._in_flight[i], e.restarts)
                for i, e in enumerate(self.engines)]

    async def engine_stats(self, timeout_s: float = 2.0) -> list[tuple[EngineStatus, EngineStats | None]]:
        """Each engine's status and counters (None: down, or no answer within timeout_s, so
        one stuck engine cannot blank the others)."""

        async def one(e: PoolMember) -> EngineStats | None:
            if not e.healthy:
                return None
            try:
                return await asyncio.wait_for(e.stats(), timeout_s)
            except (EngineUnavailable, TimeoutError):
                return None

        got = await asyncio.gather(*(one(e) for e in self.engines))
        return list(zip(self.statuses(), got))

    def holder(self, request_id: str) -> int | None:
        """Index of the engine holding a request (None when no stream of that id is open)."""
        return self._owner.get(request_id)
