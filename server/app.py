"""The aiohttp application: routes, middlewares (request ids, metrics, error shaping, auth,
admission) and the shared context. `build_app` is the only entry point.

Middleware order (outermost first): request id -> metrics -> errors -> auth -> speech routes
(refused at once when the model has no speech) -> body (read within http_body_timeout_s) ->
admission.
Admission (server.admission) is a counter, not a queue, and counts work, not sockets: an HTTP
generation request over `max_concurrent_requests` (or its client's `max_requests_per_client`)
gets 429 with Retry-After at once; a WebSocket upgrade is refused (429, before the upgrade)
only over `max_open_sessions`, and the session then takes a work slot only while it has work
in flight. Slow clients: `server_options` bounds the time to a complete request head
(http_header_timeout_s).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web

from server.admission import ADMISSION, Admission, client_of
from server.auth import presented_key
from server.context import CTX, ServerContext
from server.engine_api import EngineClientProtocol, EngineOverloaded, EngineUnavailable
from server.engine_pool import EnginePool, session_affinity
from server.errors import (
    APIError,
    engine_unavailable,
    internal_error,
    not_found,
    overloaded,
    request_timeout,
    schema_api_error,
    unauthorized,
)
from server.metrics import Metrics
from server.routes import (
    cartesia_ws,
    completions,
    elevenlabs_http,
    elevenlabs_ws,
    generate_ws,
    info,
    speech,
    tts_ws,
    voices,
)
from server.settings import ServerSettings
from server.tokenizer import TextTokenizer
from server.tts.voices import SpeechProfile, no_speech_error
from server.ws_common import close_all
from streaming.sampling_params import InvalidRequest

log = logging.getLogger(__name__)

REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

STATIC_DIR = Path(__file__).parent / "static"
# HTTP routes that start engine work and so hold a work slot while they run.
ADMITTED_ROUTES = frozenset({"speech", "completions", *elevenlabs_http.ROUTE_NAMES})
# WebSocket sessions: bounded by max_open_sessions; they take work slots themselves.
SESSION_ROUTES = frozenset({"speech_ws", "elevenlabs_ws", "elevenlabs_multi_ws", "cartesia_ws", "generate_ws"})
# Routes that need the model's speech profile.
SPEECH_ROUTES = frozenset({"speech", "speech_ws", "elevenlabs_ws", "elevenlabs_multi_ws", "cartesia_ws",
                           *elevenlabs_http.ROUTE_NAMES})
# ElevenLabs clients may send their key in the first message instead: the session checks it.
KEY_IN_FIRST_MESSAGE = frozenset({"elevenlabs_ws", "elevenlabs_multi_ws"})
# Routes that read their own (multipart) body, bounded in size and time there.
STREAMED_BODY_ROUTES = frozenset({"voice_create"})
# Reachable without an API key: probes, scrapers and the demo page (which asks for the key).
OPEN_PATHS = frozenset({"/", "/health", "/metrics"})


def server_options(settings: ServerSettings) -> dict[str, Any]:
    """aiohttp server arguments (web.AppRunner / TestServer) for the slow-client limits.

    aiohttp has no header-read timeout of its own, but its keep-alive timer is one: it is armed
    when a connection opens and after each response, and when it fires on a connection still
    waiting for a complete request head (nothing sent, or a head trickling in) it closes it.
    Bodies are bounded by the app itself (http_body_timeout_s, a 408)."""
    return {"keepalive_timeout": settings.http_header_timeout_s}


def _endpoint(request: web.Request) -> str:
    """Bounded-cardinality label: the route template, never the raw path."""
    route = request.match_info.route
    resource = route.resource
    return resource.canonical if resource is not None else "unmatched"


def build_app(
    engine: EngineClientProtocol | EnginePool, tokenizer: TextTokenizer, profile: SpeechProfile, settings: ServerSettings
) -> web.Application:
    if profile.speaks and profile.add_bos and tokenizer.bos_token_id is None:
        raise ValueError("the speech profile adds BOS but the tokenizer has no BOS token")
    if profile.speaks and engine.info.sample_rate not in (0, profile.sample_rate):
        raise ValueError(
            f"the engine's codec produces {engine.info.sample_rate} Hz but the speech profile says {profile.sample_rate} Hz"
        )
    ctx = ServerContext(engine=EnginePool.of(engine), tokenizer=tokenizer, profile=profile, settings=settings, metrics=Metrics())
    admission = Admission(settings)

    @web.middleware
    async def request_id(request: web.Request, handler: Handler) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "")
        if not rid or len(rid) > 128 or not rid.isprintable():
            rid = uuid.uuid4().hex
        request[REQUEST_ID] = rid
        return await handler(request)

    @web.middleware
    async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        except BaseException:
            status = 499  # cancelled: the client went away (nginx's convention)
            raise
        finally:
            ctx.metrics.requests.labels(_endpoint(request), str(status)).inc()

    @web.middleware
    async def shape_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except InvalidRequest as e:  # a schema rejection, or an engine-side one no handler mapped
            return schema_api_error(e).response()
        except EngineOverloaded as e:
            return overloaded(e.retry_after_s, f"The engine is at capacity: {e}").response()
        except EngineUnavailable:
            return engine_unavailable(settings.retry_after_s).response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            if e.status == 404:
                return not_found(f"Unknown path: {request.path}").response()
            # the reason as a word, as every other error's code ("Method Not Allowed" -> method_not_allowed)
            code = e.reason.lower().replace(" ", "_").replace("-", "_")
            return APIError(e.status, f"{e.reason}: {request.method} {request.path}", code=code).response()
        except Exception:
            # A bug: keep the traceback in the log, give the client a well-formed 500.
            log.exception("unhandled error in %s %s", request.method, request.path)
            return internal_error().response()

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if settings.api_key is None or request.path in OPEN_PATHS:
            return await handler(request)
        key = presented_key(request)
        if key is None and request.match_info.route.name in KEY_IN_FIRST_MESSAGE:
            return await handler(request)
        if key is None or not hmac.compare_digest(key.encode(), settings.api_key.encode()):
            raise unauthorized()
        return await handler(request)

    @web.middleware
    async def speech_only(request: web.Request, handler: Handler) -> web.StreamResponse:
        # a model without speech answers every speech route with one clear error (before a
        # WebSocket upgrade, so the client's handshake fails with it)
        if not profile.speaks and request.match_info.route.name in SPEECH_ROUTES:
            raise no_speech_error()
        return await handler(request)

    @web.middleware
    async def read_body_in_time(request: web.Request, handler: Handler) -> web.StreamResponse:
        # The body is read here, before a work slot is taken, so a slow upload holds no slot;
        # handlers' request.read() then returns the cached bytes.
        if request.body_exists and request.match_info.route.name not in STREAMED_BODY_ROUTES:
            try:
                async with asyncio.timeout(settings.http_body_timeout_s):
                    await request.read()
            except TimeoutError:
                raise request_timeout(settings.http_body_timeout_s) from None
        return await handler(request)

    @web.middleware
    async def admit(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.name
        if route in ADMITTED_ROUTES:
            client = client_of(request)
            refusal = admission.try_enter(client)
            leave = partial(admission.leave, client)
        elif route in SESSION_ROUTES:
            refusal = admission.try_open_session()
            leave = admission.close_session
        else:
            return await handler(request)
        if refusal is not None:
            ctx.metrics.rejected.labels(_endpoint(request)).inc()
            raise refusal
        try:
            if route in SESSION_ROUTES:
                with session_affinity():  # a session's requests stay on one engine (server.engine_pool)
                    return await handler(request)
            return await handler(request)
        finally:
            leave()

    async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
        if REQUEST_ID in request:
            response.headers["X-Request-Id"] = request[REQUEST_ID]

    async def index(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    app = web.Application(
        middlewares=[request_id, count_requests, shape_errors, authenticate, speech_only, read_body_in_time, admit],
        client_max_size=max(2**20, 4 * settings.max_input_chars + 2**16),
    )
    app[CTX] = ctx
    app[ADMISSION] = admission
    app.on_response_prepare.append(add_request_id_header)

    async def close_websockets(app: web.Application) -> None:
        await close_all(ctx.websockets)

    app.on_shutdown.append(close_websockets)
    app.router.add_get("/", index, name="index")
    app.router.add_post("/v1/audio/speech", speech.create_speech, name="speech")
    app.router.add_get(tts_ws.SPEECH_WS_ENDPOINT, tts_ws.speech_stream, name="speech_ws")
    app.router.add_get(elevenlabs_ws.STREAM_INPUT, elevenlabs_ws.stream_input, name="elevenlabs_ws")
    app.router.add_get(elevenlabs_ws.MULTI_STREAM_INPUT, elevenlabs_ws.multi_stream_input, name="elevenlabs_multi_ws")
    for path, handler, name in elevenlabs_http.ROUTES:
        app.router.add_post(path, handler, name=name)
    app.router.add_get(cartesia_ws.ENDPOINT, cartesia_ws.tts_websocket, name="cartesia_ws")
    app.router.add_post("/v1/completions", completions.create_completion, name="completions")
    app.router.add_get(generate_ws.ENDPOINT, generate_ws.generate_stream, name="generate_ws")
    app.router.add_get("/v1/models", info.list_models, name="models")
    app.router.add_get("/v1/models/{model}", info.get_model, name="model")
    app.router.add_get("/v1/audio/voices", info.list_voices, name="voices")
    app.router.add_post(voices.ENDPOINT, voices.create_voice, name="voice_create")
    app.router.add_delete(voices.ENDPOINT + "/{voice_id}", voices.delete_voice, name="voice_delete")
    app.router.add_get("/health", info.health, name="health")
    app.router.add_get("/metrics", info.metrics, name="metrics")
    app.router.add_get("/v1/engine/stats", info.engine_stats, name="engine_stats")
    return app
