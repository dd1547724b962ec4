"""Read-only endpoints: GET /v1/models, /v1/models/{model}, /v1/audio/voices, /health, /metrics."""

from __future__ import annotations

import time

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from server.context import ServerContext, get_ctx
from server.engine_pool import sum_stats
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
            "voices": [{"voice_id": v, "name": v, "type": "builtin"} for v in (profile.spec.voices if profile.spec else ())]
            + [v.info() for v in (profile.store.list() if profile.store is not None else ())],
            "default_voice": profile.default_voice,
            "sample_rate": profile.sample_rate,
        }
    )


async def health(request: web.Request) -> web.Response:
    """ok (200) while every engine is up, degraded (200: still serving) while some are,
    unavailable (503) while none is; `engines` lists each (pid, device, requests in flight)."""
    ctx = get_ctx(request)
    engines = ctx.engine.statuses()
    up = sum(e.healthy for e in engines)
    status = "ok" if up == len(engines) else "degraded" if up else "unavailable"
    body = {"status": status, "model": ctx.model_name, "engines": msgspec.to_builtins(engines)}
    return web.json_response(body, status=200 if up else 503)


async def engine_stats(request: web.Request) -> web.Response:
    """The engines' scheduler/KV counters as JSON, summed, and each engine's under `engines`
    (operators and tests: a disconnect must leave no active request and every KV block free)."""
    ctx = get_ctx(request)
    per_engine = await ctx.engine.engine_stats(_STATS_TIMEOUT_S)
    answered = [stats for _, stats in per_engine if stats is not None]
    if not answered:
        return web.json_response({"status": "unavailable", "error": "no engine answered"}, status=503)
    body = msgspec.to_builtins(sum_stats(answered))
    body["engines"] = [{**msgspec.to_builtins(status), "stats": msgspec.to_builtins(stats)}
                       for status, stats in per_engine]
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    ctx = get_ctx(request)
    ctx.metrics.set_engines(await ctx.engine.engine_stats(_STATS_TIMEOUT_S))
    return web.Response(body=ctx.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
