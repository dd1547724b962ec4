"""Start-up: config tree -> engine process -> front end (HTTP/WebSocket + ZeroMQ gateway)."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
from collections.abc import Callable
from urllib.parse import urlparse

from aiohttp import web

from runner.config import Env
from runner.engine.process import EngineProcArgs
from server.gc_tuning import settle_heap

log = logging.getLogger("omnistream")


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


def engine_args_from(args: argparse.Namespace, model_path: str, env: Env) -> EngineProcArgs:
    return EngineProcArgs(
        model_path=model_path,
        input_addr="",
        output_addr="",
        codec_path=args.codec,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        admission_wait_ms=args.admission_wait_ms,
        max_model_len=args.max_model_len,
        kv_memory_gb=args.kv_memory_gb,
        enable_prefix_caching=not args.no_prefix_caching,
        async_scheduling=not args.no_async_scheduling,
        cuda_graphs=not args.no_cuda_graphs,
        hidden_state_graphs=not args.no_hidden_state_graphs,
        random_weights=args.random_weights,
        codec_dtype=args.codec_dtype,
        cpu_threads=args.cpu_threads,
        log_level=env.log_level,
    )


async def run_server(args: argparse.Namespace) -> None:
    from runner.models.default_model import ensure_default_model
    from server.app import build_app
    from server.engine_client import EngineClient
    from server.routes.zmq_gateway import ZmqGateway
    from server.settings import ServerSettings
    from server.tokenizer import TextTokenizer
    from server.tts.voices import SpeechProfile

    env = Env.read()
    if args.zmq_endpoint != "none" and not args.zmq_allow_remote and not _is_loopback_endpoint(args.zmq_endpoint):
        raise SystemExit(f"--zmq-endpoint {args.zmq_endpoint}: not a loopback/ipc address; pass --zmq-allow-remote to bind it")
    model_path = args.model or str(ensure_default_model(args.cache_dir or env.cache_dir))
    if args.model is None:
        log.warning("serving the embedded tiny random-weight model: it speaks noise. Use --model for real weights.")
    settings = ServerSettings(host=args.host, port=args.port, api_key=args.api_key,
                              max_concurrent_requests=args.max_concurrent_requests)
    tokenizer = TextTokenizer.from_folder(model_path)
    profile = SpeechProfile.load(model_path)
    engine = EngineClient(engine_args_from(args, model_path, env), queue_bound=settings.output_queue_size)
    await engine.start()
    gateway = None
    runner = None
    try:
        app = build_app(engine, tokenizer, profile, settings)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        if args.zmq_endpoint != "none":
            gateway = ZmqGateway(engine, tokenizer, profile, args.zmq_endpoint)
            await gateway.start()
        # as in the engine process: full collections over the start-up heap would stall every
        # stream's event loop for ~100+ ms; and thresholds for session bursts (server/gc_tuning.py)
        settle_heap()
        port = site._server.sockets[0].getsockname()[1] if site._server else args.port  # the real port for --port 0
        print(f"omnistream ready on http://{args.host}:{port} (zmq: {args.zmq_endpoint}, model: {model_path})", flush=True)
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
    with asyncio.Runner(loop_factory=event_loop_factory()) as r:
        r.run(run_server(args))
    return 0
