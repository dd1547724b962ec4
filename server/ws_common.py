"""Plumbing shared by the WebSocket endpoints: socket limits, JSON text frames, error events,
and the guard that keeps a session's failure inside the WebSocket protocol.

Once a socket is upgraded nothing may answer it with an HTTP response (aiohttp's error
middleware would write one into the socket and the client would hang): a client's mistake is
an `error` event, and when the message cannot be read at all, a close code after it (1007
invalid payload, 1009 too big, 1008 policy); a server fault is an `error` event and 1011.

Idle sessions: every session has an inactivity clock (`SessionActivity`): no client message
and no work in flight for `ws_inactivity_timeout_s` (or the client's `?inactivity_timeout=`)
ends it with an `inactivity_timeout` error event and close 1008. Any message counts as
activity; `{"type": "ping"}` (answered `{"type": "pong"}`) is the keepalive of the speech
and generate streams, `{"text": " "}` that of ElevenLabs' stream-input. Protocol-level pings
are answered but are not activity (client libraries send them on their own). The session's
work slot (server.admission) is held only while work is in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import WSCloseCode, WSMessage, WSMsgType, web

from server.admission import WorkSlot, admission_of, client_of
from server.context import get_ctx
from server.errors import APIError, invalid_request
from server.settings import ServerSettings
from streaming.schema import (
    INVALID_JSON,
    INVALID_UNICODE,
    JSON_TOO_DEEP,
    SchemaError,
    decode_json_object,
)

log = logging.getLogger(__name__)


class BadMessage(Exception):
    """A client message the session answers with an `error` event (`code` is on the wire);
    with `close`, the session then ends with that close code."""

    def __init__(self, code: str, message: str, param: str | None = None, close: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.close = close


# Schema codes that mean the message could not be read; the rest are one field's mistake.
_UNREADABLE: dict[str, int | None] = {
    INVALID_JSON: None,  # a typo: say so and keep the session
    JSON_TOO_DEEP: WSCloseCode.MESSAGE_TOO_BIG,
    INVALID_UNICODE: WSCloseCode.INVALID_TEXT,
}


def bad_message(e: SchemaError) -> BadMessage:
    """A schema rejection as a WebSocket error event: `invalid_field` naming the field, or the
    payload's own code (and close code) when the message could not be read."""
    if e.code in _UNREADABLE:
        return BadMessage(e.code, str(e), e.field, close=_UNREADABLE[e.code])
    return BadMessage("invalid_field", str(e), e.field)


def read_message(data: str, settings: ServerSettings) -> dict:
    """A text frame -> a JSON object: size, then depth (before parsing), then JSON."""
    limit = settings.max_ws_message_bytes
    if too_large(data, limit):
        raise BadMessage("message_too_large", f"Messages are limited to {limit} bytes.", close=WSCloseCode.MESSAGE_TOO_BIG)
    try:
        return decode_json_object(data, settings.max_json_depth)
    except SchemaError as e:
        raise bad_message(e) from None


async def reject(ws: web.WebSocketResponse, e: BadMessage) -> None:
    """The error event, then the close when the mistake ends the session."""
    await send_error(ws, e.code, e.message, e.param)
    if e.close is not None and not ws.closed:
        await ws.close(code=e.close, message=e.code.encode())


async def guard_session(ws: web.WebSocketResponse, session: Callable[[], Awaitable[None]],
                        endpoint: str) -> web.WebSocketResponse:
    """Build and run an upgraded session; a bug in either becomes an error event and close 1011
    instead of an exception reaching the HTTP error middleware (which would write a 500 into the
    socket). The session is built here, inside the guard, so a failing constructor is covered."""
    try:
        await session()
    except ConnectionError:  # the client went away (reset, or aiohttp's "Connection lost")
        pass
    except Exception:  # a bug: the traceback goes to the log, the client gets a proper close
        log.exception("%s: session failed", endpoint)
        try:
            await send_error(ws, "internal_error", "The session failed on the server; see its log.")
            await ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error")
        except ConnectionError:
            pass
    return ws


class PingMessage(msgspec.Struct, forbid_unknown_fields=True):
    """{"type": "ping"}: a keepalive, answered {"type": "pong"}."""

    type: str


class SessionActivity:
    """One session's inactivity clock and its work slot: `start_work` takes the slot (or says
    why not), `end_work` gives it back and restarts the clock; while the slot is held the
    session is busy and never idle."""

    def __init__(self, timeout_s: float, slot: WorkSlot):
        self.timeout_s = timeout_s
        self._slot = slot
        self._last = time.monotonic()

    @property
    def busy(self) -> bool:
        return self._slot.held

    def touch(self) -> None:
        self._last = time.monotonic()

    def start_work(self) -> APIError | None:
        return self._slot.acquire()

    def end_work(self) -> None:
        if self._slot.held:
            self._slot.release()
            self.touch()  # idle from now on

    def idle_s(self) -> float:
        return 0.0 if self.busy else time.monotonic() - self._last

    def next_check_s(self) -> float:
        """How long the reader may wait for a message before looking at the clock again."""
        if self.busy:
            return self.timeout_s
        return max(self.timeout_s - self.idle_s(), 0.001)


def inactivity_timeout(request: web.Request) -> float:
    """The session's timeout: `?inactivity_timeout=` (seconds, as ElevenLabs' parameter) within
    [1, ws_max_inactivity_timeout_s], else the server's ws_inactivity_timeout_s. Checked before
    the upgrade, so a bad value is a 400 naming the parameter."""
    settings = get_ctx(request).settings
    raw = request.query.get("inactivity_timeout")
    if raw is None:
        return settings.ws_inactivity_timeout_s
    top = settings.ws_max_inactivity_timeout_s
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (1.0 <= value <= top):  # NaN fails too
        raise invalid_request(
            f"inactivity_timeout: must be a number of seconds in [1, {top:g}], got {raw!r}", param="inactivity_timeout"
        )
    return value


def session_activity(request: web.Request) -> SessionActivity:
    """The new session's clock and (not yet held) work slot; raises the 400 for a bad
    `inactivity_timeout` before the upgrade."""
    return SessionActivity(inactivity_timeout(request), WorkSlot(admission_of(request), client_of(request)))


class CloseRequest:
    """A close that a session's other task (the speaker's writer, a generation) asks of the
    session's reader, which then does it.

    Why the reader: aiohttp's `close()` waits for the client's Close frame only when the task
    that reads the socket calls it. Called from another task while the reader waits in
    `receive()`, it sends our Close, wakes the reader with a CLOSING message (which marks the
    socket as closing) and then closes TCP at once, without reading the client's answer; the
    reader's loop ends and the handler returns. A client that is still sending (its next
    message already on the wire) then gets a reset from our kernel, and its kernel discards
    what it had not yet read: our last event and Close frame; the client sees an abnormal
    closure (1006). So other tasks only ask (`request`: sets the code and wakes the reader out
    of its wait), and `messages` closes from the reader: aiohttp then reads, discarding, until
    the client's Close (or its close timeout) before the iteration ends, the handler returns
    and TCP is closed, as RFC 6455 7.1.1 wants. The session's last event (session.done)
    travels with the request and is sent by the reader too, so no answer to a message read
    meanwhile can come after it."""

    def __init__(self) -> None:
        self.code: int | None = None
        self.message = b""
        self.last_event: dict | None = None
        self._reader_wait: asyncio.Timeout | None = None  # the reader's current wait, if it waits

    @property
    def requested(self) -> bool:
        return self.code is not None

    def request(self, code: int, message: bytes = b"", last_event: dict | None = None) -> None:
        """Ask the reader to send `last_event` (if any) and close with this code; the first
        request stands."""
        if self.code is not None:
            return
        self.code, self.message, self.last_event = code, message, last_event
        if self._reader_wait is not None and not self._reader_wait.expired():
            # Expire the reader's deadline now: its receive() is cancelled before it took a
            # message (nothing is lost) and `messages` sees the request.
            self._reader_wait.reschedule(asyncio.get_running_loop().time())

    async def close(self, ws: web.WebSocketResponse) -> None:
        """Called by the reader: the last event, our Close, then the client's, then TCP closes."""
        assert self.code is not None
        try:
            if self.last_event is not None and not ws.closed:
                await send_json(ws, self.last_event)
            await ws.close(code=self.code, message=self.message)
        except ConnectionError:  # reset, or aiohttp's "Connection lost"
            pass


async def dispatch_text(ws: web.WebSocketResponse, activity: SessionActivity, closer: CloseRequest, endpoint: str,
                        on_text: Callable[[str], Awaitable[None]], on_binary: Callable[[], Awaitable[None]]) -> None:
    """Every session's read loop: each text frame to `on_text`, a binary frame to `on_binary`
    (the sessions speak JSON), until the client closes, idles out or resets, or another task
    asks `closer` for a close; a socket error ends it too (logged)."""
    try:
        async for msg in messages(ws, activity, closer):
            if msg.type is WSMsgType.TEXT:
                await on_text(msg.data)
            elif msg.type is WSMsgType.BINARY:
                await on_binary()
            elif msg.type is WSMsgType.ERROR:
                log.info("%s: websocket error: %s", endpoint, ws.exception())
                break
    except ConnectionError:  # reset, or aiohttp's "Connection lost"
        pass


async def messages(
    ws: web.WebSocketResponse, activity: SessionActivity, closer: CloseRequest
) -> AsyncIterator[WSMessage]:
    """The client's messages (as `async for msg in ws`), each one restarting the inactivity
    clock; when the session has been idle too long, it is closed (error event + 1008) and the
    iteration ends. When another task asked `closer` for a close, this reader closes (waiting
    for the client's Close) and the iteration ends."""
    while True:
        if closer.requested:
            await closer.close(ws)
            return
        try:
            # our own deadline, not receive(timeout=): aiohttp restarts that one after every
            # protocol ping it answers, which would make pings count as activity
            async with asyncio.timeout(activity.next_check_s()) as deadline:
                closer._reader_wait = deadline
                try:
                    msg = await ws.receive()
                finally:
                    closer._reader_wait = None
        except TimeoutError:
            if not closer.requested and activity.idle_s() >= activity.timeout_s:
                await close_idle(ws, activity.timeout_s)
                return
            continue
        if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
            return
        activity.touch()
        yield msg


async def close_idle(ws: web.WebSocketResponse, timeout_s: float) -> None:
    try:
        await send_error(
            ws,
            "inactivity_timeout",
            f"No message and nothing in flight for {timeout_s:g} s; closing. Send any message (a ping) to keep "
            "the session open, or pass ?inactivity_timeout= (ws_inactivity_timeout_s).",
        )
        await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"inactivity timeout")
    except ConnectionError:  # reset, or aiohttp's "Connection lost"
        pass


async def overloaded_event(ws: web.WebSocketResponse, refusal: APIError, param: str | None = None, **extra) -> None:
    """A work slot refused inside a session: an `overloaded` error event; the session goes on."""
    retry = refusal.headers.get("Retry-After")
    await send_error(ws, "overloaded", refusal.message, param, retry_after_s=int(retry) if retry else None, **extra)


def new_websocket(request: web.Request) -> web.WebSocketResponse:
    """A WebSocket with the configured limits, registered so shutdown can close it."""
    ctx = get_ctx(request)
    settings = ctx.settings
    ws = web.WebSocketResponse(
        # aiohttp's own limit sits above ours: over it the socket closes before we could say why.
        max_msg_size=settings.ws_hard_message_bytes,
        heartbeat=settings.ws_heartbeat_s,
        compress=False,  # PCM and float rows barely compress; deflate would only cost CPU
    )
    ctx.websockets.add(ws)
    return ws


async def close_all(websockets: weakref.WeakSet[web.WebSocketResponse]) -> None:
    """On shutdown: tell every open session the server is going away (1001), so handlers end
    now instead of holding shutdown until their clients leave."""
    open_ones = [ws for ws in list(websockets) if not ws.closed]
    await asyncio.gather(
        *(ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down") for ws in open_ones),
        return_exceptions=True,  # a peer that vanished meanwhile must not stop the others
    )


def too_large(data: str, limit: int) -> bool:
    # Counting UTF-8 bytes costs an encode, so only when the text could be over the limit.
    return len(data) > limit or (len(data) * 4 > limit and len(data.encode("utf-8")) > limit)


async def send_json(ws: web.WebSocketResponse, obj: dict) -> None:
    await ws.send_str(json.dumps(obj, separators=(",", ":")))


async def send_error(ws: web.WebSocketResponse, code: str, message: str, param: str | None = None, **extra) -> None:
    if not ws.closed:
        await send_json(ws, {"type": "error", "code": code, "message": message, "param": param, **extra})
