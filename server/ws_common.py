"""Plumbing shared by the WebSocket endpoints: socket limits, JSON text frames, error events."""

from __future__ import annotations

import asyncio
import json
import weakref

from aiohttp import WSCloseCode, web

from server.context import get_ctx


class BadMessage(Exception):
    """A client message the session answers with an `error` event (`code` is on the wire)."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


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


async def close_all(websockets: "weakref.WeakSet[web.WebSocketResponse]") -> None:
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


def parse_json_object(data: str) -> dict:
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise BadMessage("invalid_json", f"The message is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadMessage("invalid_json", "A message must be a JSON object.")
    return obj


async def send_json(ws: web.WebSocketResponse, obj: dict) -> None:
    await ws.send_str(json.dumps(obj, separators=(",", ":")))


async def send_error(ws: web.WebSocketResponse, code: str, message: str, param: str | None = None, **extra) -> None:
    if not ws.closed:
        await send_json(ws, {"type": "error", "code": code, "message": message, "param": param, **extra})
