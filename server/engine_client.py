"""The front end's asyncio client of the engine process.

It spawns `python -m MODULE ARGS_JSON` (the engine backend's module, `runner.engine.process` for
the native engine: no multiprocessing pickling, arguments travel as JSON), binds a PUSH socket for requests and a PULL socket for outputs on ipc:// paths in a
private temp dir, waits for the engine's Ready, then routes every step's outputs to per-request
bounded queues.

Rules:
- a consumer that stops iterating (client disconnect, cancel) aborts its request in the engine;
- a consumer that falls more than `queue_bound` steps behind has its request aborted with an
  error, so one slow reader can never grow memory or stall the others;
- if the engine process dies, every in-flight request fails at once with EngineUnavailable,
  `healthy` turns False, and (when `restart` is set) a new engine is started.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import AsyncIterator, Mapping

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from runner.engine.args import EngineProcArgs
from server.engine_api import EngineOverloaded, EngineUnavailable
from server.settings import ENGINE_MODULES
from streaming import ipc
from streaming.sampling_params import InvalidRequest

log = logging.getLogger("omnistream.client")

_END = object()


class _Stream:
    __slots__ = ("queue", "finished", "error")

    def __init__(self, bound: int):
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=bound)
        self.finished = False
        self.error: BaseException | None = None


class EngineClient:
    def __init__(self, args: EngineProcArgs, *, queue_bound: int = 512, max_pending: int = 1024,
                 startup_timeout: float = 600.0, restart: bool = True, module: str = ENGINE_MODULES["native"],
                 env: Mapping[str, str] | None = None, device: str = "", name: str = "engine"):
        self._base_args = args
        self.module = module  # the engine backend, fixed for this client's life (restarts included)
        self._env = dict(env or {})  # e.g. CUDA_VISIBLE_DEVICES of a data-parallel engine
        self.device = device or args.runner.device  # shown per engine in /health and /metrics
        self.name = name  # in log lines: which engine of a data-parallel group
        self.queue_bound = queue_bound
        self.max_pending = max_pending
        self.startup_timeout = startup_timeout
        self.restart = restart
        self.info: ipc.Ready | None = None
        self._streams: dict[str, _Stream] = {}
        self._stats_waiters: list[asyncio.Future] = []
        self._encode_waiters: dict[str, asyncio.Future] = {}  # EncodeAudio request id -> its answer
        self._proc: subprocess.Popen | None = None
        self._ctx = zmq.asyncio.Context()
        self._tmp = tempfile.mkdtemp(prefix="omnistream-")
        self._gen = itertools.count()
        self._alive = False
        self._closing = False
        self._tasks: list[asyncio.Task] = []
        self.restarts = 0
        self.dead_reason = ""

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        n = next(self._gen)
        in_addr = f"ipc://{self._tmp}/in-{n}"
        out_addr = f"ipc://{self._tmp}/out-{n}"
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(out_addr)
        args = msgspec.structs.replace(self._base_args, input_addr=in_addr, output_addr=out_addr)
        env = dict(os.environ, **self._env)
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")])
        self._proc = subprocess.Popen(
            [sys.executable, "-m", self.module, msgspec.json.encode(args).decode()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if await self._pull.poll(200):
                msg = ipc.decode_outbound(await self._pull.recv_multipart(copy=False))
                if isinstance(msg, ipc.Ready):
                    self.info = msg
                    break
                if isinstance(msg, ipc.EngineDead):
                    await self._kill()
                    raise EngineUnavailable(msg.reason)
            if self._proc.poll() is not None:
                raise EngineUnavailable(f"engine process exited with code {self._proc.returncode} during start-up")
            if time.monotonic() > deadline:
                await self._kill()
                raise EngineUnavailable("engine start-up timed out")
        self._alive = True
        self.dead_reason = ""
        self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._watchdog())]

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        # Let the reader's pending recv end before its socket closes and the context terminates
        # (a recv still pending at term() raises ContextTerminated).
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._proc is not None and self._proc.poll() is None:
            try:
                await self._push.send(ipc.encode_inbound(ipc.Shutdown()))
            except zmq.ZMQError:
                pass
            await self._kill()
        self._alive = False
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()
        shutil.rmtree(self._tmp, ignore_errors=True)

    async def _kill(self, grace: float = 10.0) -> None:
        p = self._proc
        if p is None or p.poll() is not None:
            return
        p.terminate()
        t0 = time.monotonic()
        while p.poll() is None and time.monotonic() - t0 < grace:
            await asyncio.sleep(0.05)
        if p.poll() is None:
            p.kill()
            p.wait()

    @property
    def healthy(self) -> bool:
        return self._alive

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # ---- background tasks ----------------------------------------------------------------------

    async def _reader(self) -> None:
        while True:
            frames = await self._pull.recv_multipart(copy=False)
            msg = ipc.decode_outbound([f.buffer for f in frames])
            if isinstance(msg, list):
                for out in msg:
                    self._route(out)
            elif isinstance(msg, ipc.EngineStats):
                waiters, self._stats_waiters = self._stats_waiters, []
                for w in waiters:
                    if not w.done():
                        w.set_result(msg)
            elif isinstance(msg, ipc.EncodedAudio):
                w = self._encode_waiters.pop(msg.request_id, None)
                if w is not None and not w.done():
                    w.set_result(msg)
            elif isinstance(msg, ipc.EngineDead):
                self.dead_reason = msg.reason
                log.error("%s reported death: %s", self.name, msg.reason)

    def _route(self, out: ipc.RequestOutput) -> None:
        st = self._streams.get(out.request_id)
        if st is None or st.finished:
            return  # late output of an aborted request
        if out.finished:
            st.finished = True
        try:
            st.queue.put_nowait(out)
        except asyncio.QueueFull:
            # the reader fell too far behind: end it rather than buffer without bound
            st.finished = True
            st.error = EngineOverloaded("client too slow: output queue overflowed")
            self._send_abort(out.request_id)
            _drain_put(st.queue, _END)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            if self._proc is not None and self._proc.poll() is not None and not self._closing:
                code = self._proc.returncode
                self._on_death(self.dead_reason or f"engine process exited with code {code}")
                if self.restart:
                    await self._restart()
                return

    def _on_death(self, reason: str) -> None:
        self._alive = False
        log.error("%s died: %s", self.name, reason)
        for st in self._streams.values():
            if not st.finished:
                st.finished = True
                st.error = EngineUnavailable(reason)
                _drain_put(st.queue, _END)
        for w in self._stats_waiters:
            if not w.done():
                w.set_exception(EngineUnavailable(reason))
        self._stats_waiters = []
        for w in self._encode_waiters.values():
            if not w.done():
                w.set_exception(EngineUnavailable(reason))
        self._encode_waiters = {}

    async def _restart(self) -> None:
        self._tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in self._tasks:
            t.cancel()
        self._push.close(0)
        self._pull.close(0)
        delay = min(30.0, 0.5 * 2 ** min(self.restarts, 6))
        await asyncio.sleep(delay)
        self.restarts += 1
        try:
            await self.start()
            log.warning("%s restarted (%d)", self.name, self.restarts)
        except EngineUnavailable as e:
            log.error("%s restart failed: %s", self.name, e)
            if not self._closing:
                asyncio.get_running_loop().call_later(delay, lambda: asyncio.ensure_future(self._restart()))

    # ---- API ----------------------------------------------------------------------------------------

    def _send_abort(self, request_id: str) -> None:
        if self._alive:
            self._push.send(ipc.encode_inbound(ipc.AbortRequests([request_id])))

    async def generate(self, req: ipc.AddRequest) -> AsyncIterator[ipc.RequestOutput]:
        """Stream a request's per-step outputs. Raises InvalidRequest (the engine rejected a
        field), EngineOverloaded (too many in flight here, or the engine had no room for it:
        its codec's streams all in use), EngineUnavailable."""
        if not self._alive:
            raise EngineUnavailable(self.dead_reason or "engine is not running")
        if len(self._streams) >= self.max_pending:
            raise EngineOverloaded(f"{len(self._streams)} requests in flight")
        if req.request_id in self._streams:
            raise InvalidRequest("request_id", f"{req.request_id!r} is already in use")
        st = _Stream(self.queue_bound)
        self._streams[req.request_id] = st
        try:
            await self._push.send(ipc.encode_inbound(req))
            first = True
            while True:
                out = await st.queue.get()
                if out is _END:
                    raise st.error or EngineUnavailable("stream ended")
                if first and out.finished and out.error_field:
                    raise InvalidRequest(out.error_field, out.error.split(": ", 1)[-1] if out.error else "invalid")
                if first and out.finish_reason == ipc.FINISH_OVERLOADED:
                    raise EngineOverloaded(out.error or "the engine has no room for this request")
                first = False
                yield out
                if out.finished:
                    return
        finally:
            self._streams.pop(req.request_id, None)
            if not st.finished:  # consumer left early: free the engine's work within a step
                self._send_abort(req.request_id)

    async def append_text(self, request_id: str, step_text_ids: list[int], final: bool) -> None:
        """More text ids of a running request added with step_text_open (ipc.AppendText)."""
        if self._alive and request_id in self._streams:
            await self._push.send(ipc.encode_inbound(ipc.AppendText(request_id, step_text_ids, final)))

    async def abort(self, request_id: str) -> None:
        st = self._streams.get(request_id)
        if st is not None and not st.finished:
            st.finished = True
            st.error = EngineUnavailable("aborted")
            _drain_put(st.queue, _END)
        self._send_abort(request_id)

    async def stats(self) -> ipc.EngineStats:
        if not self._alive:
            raise EngineUnavailable(self.dead_reason or "engine is not running")
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        await self._push.send(ipc.encode_inbound(ipc.GetStats()))
        return await asyncio.wait_for(fut, timeout=10)

    async def encode_audio(self, pcm: bytes, timeout: float = 60.0) -> tuple[np.ndarray, np.ndarray | None]:
        """A reference clip (s16le mono at the codec's rate) -> its codes [frames, K] int16,
        encoded once by the engine's codec, and the speaker vector of a model that conditions
        on one (float32; else None). InvalidRequest (field `audio`) when the model takes no
        reference audio; EngineUnavailable when the engine is down."""
        if not self._alive:
            raise EngineUnavailable(self.dead_reason or "engine is not running")
        rid = f"encode-{next(self._gen)}"
        fut = asyncio.get_running_loop().create_future()
        self._encode_waiters[rid] = fut
        try:
            await self._push.send(ipc.encode_inbound(ipc.EncodeAudio(rid, pcm)))
            reply: ipc.EncodedAudio = await asyncio.wait_for(fut, timeout=timeout)
        finally:
            self._encode_waiters.pop(rid, None)
        if reply.error is not None:
            field, _, message = reply.error.partition(": ")
            raise InvalidRequest(field, message)
        xvec = np.frombuffer(reply.speaker_embedding, dtype="<f4").copy() if reply.speaker_embedding else None
        return np.asarray(reply.codes, dtype=np.int16).reshape(len(reply.codes), -1), xvec

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)


def _drain_put(q: asyncio.Queue, item) -> None:
    """Put a terminal marker even into a full queue (dropping the oldest buffered output)."""
    while True:
        try:
            q.put_nowait(item)
            return
        except asyncio.QueueFull:
            q.get_nowait()
