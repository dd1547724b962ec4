"""Start-up: config tree -> engine process -> front end (HTTP/WebSocket + ZeroMQ gateway)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Callable
from urllib.parse import urlparse

import msgspec
import torch
from aiohttp import web

from runner.config import (
    CacheConfig,
    ConfigError,
    Env,
    ProcessConfig,
    RunnerConfig,
    SchedulerConfig,
)
from runner.engine.args import EngineProcArgs
from runner.vllm_engine.config import VllmConfig
from server.engine_api import EngineUnavailable
from server.engine_layout import Placement, placements
from server.gc_tuning import settle_heap
from server.settings import ENGINE_MODULES, ModelSource, ServerSettings
from streaming.knobs import from_arguments
from streaming.profile import ModelProfile, ProfileError, read_profile

log = logging.getLogger("omnistream")

# Start-up failures that name what to fix (a missing file, a bad option or profile field, an
# engine that could not load the model); anything else is a bug and keeps its traceback.
STARTUP_ERRORS = (ProfileError, ConfigError, FileNotFoundError, EngineUnavailable)


def _is_loopback_endpoint(endpoint: str) -> bool:
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = urlparse(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def engine_args_from(args: argparse.Namespace, model_path: str, profile: ModelProfile, log_level: str) -> EngineProcArgs:
    """The engine process's arguments from `serve`'s options (derived from the same dataclasses)."""
    return EngineProcArgs(
        model_path=model_path,
        profile=profile,
        cache=from_arguments(CacheConfig, args),
        scheduler=from_arguments(SchedulerConfig, args),
        runner=from_arguments(RunnerConfig, args),
        process=from_arguments(ProcessConfig, args),
        vllm=from_arguments(VllmConfig, args),
        log_level=log_level,
    )


def engine_layout(settings: ServerSettings, base: EngineProcArgs) -> list[tuple[EngineProcArgs, Placement]]:
    """Each engine process's arguments and placement (server/engine_layout.py): `base` with
    the engine's device."""
    several = settings.data_parallel_size > 1 or bool(settings.device_list)
    layout = placements(base.runner.device, settings.data_parallel_size, settings.device_list,
                        cuda_count=torch.cuda.device_count() if several else 0,  # no CUDA query for one engine
                        visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
    return [(msgspec.structs.replace(base, runner=dataclasses.replace(base.runner, device=p.device)), p)
            for p in layout]


def _speech_line(p: ModelProfile) -> str:
    if p.speaks:
        return f"speech at {p.sample_rate} Hz, voices {', '.join(p.speech.voices)}"
    if p.speech is not None:
        return "no codec, so no speech: pass --codec (a local SNAC folder) or name one in omnistream.json"
    return "a text model: completions, the generate stream and ZeroMQ; no speech"


async def run_server(args: argparse.Namespace) -> None:
    from runner.models.default_model import ensure_default_model
    from server.app import build_app, server_options
    from server.engine_client import EngineClient
    from server.engine_pool import EnginePool
    from server.routes.zmq_gateway import ZmqGateway
    from server.tokenizer import TextTokenizer
    from server.tts.voice_store import VoiceStore
    from server.tts.voices import SpeechProfile

    env = Env.read()
    settings = from_arguments(ServerSettings, args)
    source = from_arguments(ModelSource, args)
    if settings.zmq_endpoint != "none" and not settings.zmq_allow_remote and not _is_loopback_endpoint(settings.zmq_endpoint):
        raise SystemExit(f"--zmq-endpoint {settings.zmq_endpoint}: not a loopback/ipc address; pass --zmq-allow-remote to bind it")
    if settings.zmq_endpoint != "none" and settings.zmq_allow_remote and settings.api_key is None:
        log.warning("--zmq-allow-remote without --api-key: anyone who can reach %s can run requests", settings.zmq_endpoint)
    model_path = source.model or str(ensure_default_model(source.cache_dir or env.cache_dir))
    if source.model is None:
        log.warning("serving the embedded tiny random-weight model: it speaks noise. Use --model for real weights.")
    tokenizer = TextTokenizer.from_folder(model_path)
    model_profile = read_profile(model_path, source.codec)  # the one read of omnistream.json
    spec = model_profile.speech if model_profile.speaks else None
    store = (VoiceStore(settings.voices_dir, settings.max_voices, spec.voices, needs_embedding=spec.clones_voices)
             if spec is not None and spec.takes_reference_audio else None)
    profile = SpeechProfile(spec, store)
    log.info("model %s: family %s, %s", model_path, model_profile.family, _speech_line(model_profile))
    log_level = (args.log_level or env.log_level).upper()
    base = engine_args_from(args, model_path, model_profile, log_level)
    layout = engine_layout(settings, base)
    module = ENGINE_MODULES[settings.engine]  # the backend, picked once
    engine = EnginePool([
        EngineClient(engine_args, queue_bound=settings.output_queue_size, module=module, env=p.env, device=p.label,
                     name=f"engine {i} ({p.label})" if len(layout) > 1 else "engine")
        for i, (engine_args, p) in enumerate(layout)])
    if len(layout) > 1:
        log.info("%d %s engines: %s", len(layout), settings.engine, ", ".join(p.label for _, p in layout))
    await engine.start()
    gateway = None
    runner = None
    try:
        app = build_app(engine, tokenizer, profile, settings)
        runner = web.AppRunner(app, handle_signals=False, **server_options(settings))
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        if settings.zmq_endpoint != "none":
            gateway = ZmqGateway(engine, tokenizer, profile, settings)
            await gateway.start()
        # as in the engine process: full collections over the start-up heap would stall every
        # stream's event loop for ~100+ ms; and thresholds for session bursts (server/gc_tuning.py)
        settle_heap()
        port = site._server.sockets[0].getsockname()[1] if site._server else settings.port  # the real port for --port 0
        print(f"omnistream ready on http://{settings.host}:{port} (zmq: {settings.zmq_endpoint}, model: {model_path})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if gateway is not None:
            await gateway.close()
        if runner is not None:
            await runner.cleanup()
        await engine.close()


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (an optional speed-up), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def serve(args: argparse.Namespace) -> int:
    env = Env.read()
    logging.basicConfig(level=(args.log_level or env.log_level).upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as r:
            r.run(run_server(args))
    except STARTUP_ERRORS as e:  # a folder or option the user can fix: one line, not a traceback
        log.debug("start-up failed", exc_info=True)
        print(f"omnistream: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
