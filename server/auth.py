"""Where a request carries its API key: one reading for the authentication middleware
(server.app) and for the ElevenLabs sockets, which let an upgrade without a key through and
then demand it in the first message."""

from __future__ import annotations

from aiohttp import web


def presented_key(request: web.Request) -> str | None:
    """`Authorization: Bearer <key>` or `xi-api-key: <key>`; a WebSocket upgrade may carry it as
    `?api_key=` / `?xi-api-key=` (browsers cannot set headers on one). None: no key given."""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    if "xi-api-key" in request.headers:
        return request.headers["xi-api-key"]
    if request.headers.get("Upgrade", "").lower() == "websocket":
        return request.query.get("api_key") or request.query.get("xi-api-key")
    return None
