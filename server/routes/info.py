"""Read-only endpoints: GET /v1/models, /v1/models/{model}, /v1/audio/voices, /health, /metrics."""

from __future__ import annotations

import asyncio
import time

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from server.context import ServerContext, get_ctx
from server.engine_api import EngineUnavailable
from server.errors import not_found

_STARTED = int(time.time())
_STATS_TIMEOUT_S = 2.0  # a scrape must not hang on a stuck engine


def _model_card(ctx: ServerContext) -> dict:
    info = ctx.engine.info
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "omnistream",
        "max_model_len": info.max_model_len,
        "sample_rate": ctx.profile.sample_rate,
        "speech": ctx.profile.speaks,
    }


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(get_ctx(request))]})


# The name the README's and the clients' examples use; any served model answers to it too.
MODEL_ALIAS = "omnistream"


async def get_model(request: web.Request) -> web.Response:
    ctx = get_ctx(request)
    if request.match_info["model"] not in (ctx.model_name, MODEL_ALIAS):
        raise not_found(f"model: {request.match_info['model']!r} is not served here; try {ctx.model_name!r}", "model")
    return web.json_response(_model_card(ctx))


async def list_voices(request: web.Request) -> web.Response:
    profile = get_ctx(request).profile
    return web.json_response(
        {
            "voices": [{"voice_id": v, "name": v} for v in profile.voices],
            "default_voice": profile.default_voice,
            "sample_rate": profile.sample_rate,
        }
    )


async def health(request: web.Request) -> web.Response:
    ctx = get_ctx(request)
    if ctx.engine.healthy:
        return web.json_response({"status": "ok", "model": ctx.model_name})
    return web.json_response({"status": "unavailable", "model": ctx.model_name}, status=503)


async def engine_stats(request: web.Request) -> web.Response:
    """The engine's scheduler/KV counters as JSON (operators and tests: a disconnect must
    leave no active request and every KV block free)."""
    ctx = get_ctx(request)
    try:
        stats = await asyncio.wait_for(ctx.engine.stats(), _STATS_TIMEOUT_S)
    except (EngineUnavailable, asyncio.TimeoutError) as e:
        return web.json_response({"status": "unavailable", "error": str(e) or type(e).__name__}, status=503)
    return web.json_response(msgspec.to_builtins(stats))


async def metrics(request: web.Request) -> web.Response:
    ctx = get_ctx(request)
    stats = None
    if ctx.engine.healthy:
        try:
            stats = await asyncio.wait_for(ctx.engine.stats(), _STATS_TIMEOUT_S)
        except (EngineUnavailable, asyncio.TimeoutError):
            stats = None
    ctx.metrics.set_engine(stats, healthy=stats is not None)
    return web.Response(body=ctx.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
