"""Helpers the WebSocket tests share."""

import asyncio
import json


async def recv_json(ws, timeout: float = 2.0) -> dict:
    msg = await asyncio.wait_for(ws.recv(), timeout)
    assert isinstance(msg, str), f"expected a JSON text frame, got {len(msg)} bytes"
    return json.loads(msg)
