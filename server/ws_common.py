"""Plumbing shared by the WebSocket endpoints: socket limits, JSON text frames, error events,
and the guard that keeps a session's failure inside the WebSocket protocol.

Once a socket is upgraded nothing may answer it with an HTTP response (aiohttp's error
middleware would write one into the socket and the client would hang): a client's mistake is
an `error` event, and when the message cannot be read at all, a close code after it (1007
invalid payload, 1009 too big, 1008 policy); a server fault is an `error` event and 1011.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import Awaitable

from aiohttp import WSCloseCode, web

from server.context import get_ctx
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


async def guard_session(ws: web.WebSocketResponse, session: Awaitable[None], endpoint: str) -> web.WebSocketResponse:
    """Run an upgraded session; a bug in it becomes an error event and close 1011 instead of an
    exception reaching the HTTP error middleware (which would write a 500 into the socket)."""
    try:
        await session
    except ConnectionResetError:
        pass
    except Exception:  # a bug: the traceback goes to the log, the client gets a proper close
        log.exception("%s: session failed", endpoint)
        try:
            await send_error(ws, "internal_error", "The session failed on the server; see its log.")
            await ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error")
        except ConnectionResetError:
            pass
    return ws


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
