"""The vLLM engine process (`serve --engine vllm`): the native engine process's contract
(`python -m runner.vllm_engine.process ARGS_JSON`, ARGS_JSON an EngineProcArgs; the same
ZeroMQ messages: AddRequest / AbortRequests / GetStats / Shutdown in, Ready, RequestOutputs,
EngineStats, EngineDead out), with the model on vLLM's AsyncLLM (runner/vllm_engine/engine.py).

vLLM missing or not the pinned version: EngineDead with one line naming the extra, exit 1.
A start-up failure or vLLM's engine dying is reported as EngineDead before exiting, so the
front end fails in-flight requests fast and restarts the process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import traceback

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from runner.engine.args import EngineProcArgs
from runner.vllm_engine.config import VllmUnavailable, require_vllm
from streaming import ipc
from streaming.sampling_params import InvalidRequest

log = logging.getLogger("omnistream.vllm")

OUTBOUND_BOUND = 1024  # encoded messages waiting for the socket: backpressure on a stuck peer
CODEC_POLL_S = 0.002  # CUDA codec: how often landed windows are collected while streams are open


def _report_dead(addr: str, reason: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(addr)
    sock.send_multipart(ipc.encode_outbound(ipc.EngineDead(reason)))
    sock.close()
    ctx.term()


class VllmEngineLoop:
    def __init__(self, args: EngineProcArgs):
        from runner.vllm_engine.engine import VllmEngine

        self.args = args
        self.ctx = zmq.asyncio.Context()
        self.outbound: asyncio.Queue = asyncio.Queue(maxsize=OUTBOUND_BOUND)
        self.stop = asyncio.Event()
        self.engine = VllmEngine(args, self._emit)

    async def _emit(self, out: ipc.RequestOutput) -> None:
        await self.outbound.put(ipc.encode_outputs([out]))

    async def _writer(self, sock: zmq.asyncio.Socket) -> None:
        while (frames := await self.outbound.get()) is not None:
            await sock.send_multipart(frames, copy=False)

    async def _apply(self, msg) -> None:
        eng = self.engine
        if isinstance(msg, ipc.AddRequest):
            try:
                eng.add_request(msg)
            except InvalidRequest as e:
                await self._emit(ipc.RequestOutput(msg.request_id, finished=True, finish_reason="error", error=str(e),
                                                   error_field=e.field))
        elif isinstance(msg, ipc.EncodeAudio):
            try:
                reply = eng.encode_audio(np.frombuffer(msg.pcm, "<i2")).reply(msg.request_id)
            except InvalidRequest as e:
                reply = ipc.EncodedAudio(msg.request_id, error=str(e))
            await self.outbound.put(ipc.encode_outbound(reply))
        elif isinstance(msg, ipc.AppendText):
            pass  # its request was refused at add (step text needs --engine native)
        elif isinstance(msg, ipc.AbortRequests):
            for rid in msg.request_ids:
                await eng.abort(rid)
        elif isinstance(msg, ipc.GetStats):
            await self.outbound.put(ipc.encode_outbound(eng.stats()))
        elif isinstance(msg, ipc.Shutdown):
            self.stop.set()

    async def _reader(self) -> None:
        sock = self.ctx.socket(zmq.PULL)
        sock.connect(self.args.input_addr)
        try:
            while True:
                buf = await sock.recv(copy=False)
                try:
                    msg = ipc.decode_inbound(buf.buffer)
                except msgspec.DecodeError as e:  # a broken peer message must not kill the engine
                    log.error("dropping undecodable inbound message: %s", e)
                    continue
                await self._apply(msg)
        finally:
            sock.close(linger=0)

    async def _codec_poll(self) -> None:
        while True:
            if self.engine.codec_busy:
                await self.engine.codec_step()
            await asyncio.sleep(CODEC_POLL_S)

    async def run(self) -> int:
        out_sock = self.ctx.socket(zmq.PUSH)
        out_sock.setsockopt(zmq.LINGER, 2000)
        out_sock.connect(self.args.output_addr)
        writer = asyncio.create_task(self._writer(out_sock))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        code = 0
        tasks: list[asyncio.Task] = []
        try:
            try:
                ready = await self.engine.start()
            except Exception as e:  # start-up failure: tell the front end why, then exit non-zero
                log.error("start-up failed:\n%s", traceback.format_exc())
                await self.outbound.put(ipc.encode_outbound(ipc.EngineDead(f"engine start-up failed: {e}")))
                return 1
            await self.outbound.put(ipc.encode_outbound(ready))
            tasks = [asyncio.create_task(self._reader(), name="engine-in"),
                     asyncio.create_task(self.engine.watch(), name="vllm-watch")]
            if self.engine.codec is not None and self.engine.codec.asynchronous:
                tasks.append(asyncio.create_task(self._codec_poll(), name="codec-poll"))
            stop = asyncio.create_task(self.stop.wait())
            done, _ = await asyncio.wait([stop, self.engine.fatal, *tasks], return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            reason = None
            if self.engine.fatal.done():
                reason = self.engine.fatal.result()
            else:
                for t in tasks:
                    if t.done() and t.exception() is not None:
                        e = t.exception()
                        log.error("engine loop crashed:\n%s", "".join(traceback.format_exception(e)))
                        reason = "".join(traceback.format_exception_only(type(e), e)).strip()
            if reason is not None:
                await self.outbound.put(ipc.encode_outbound(ipc.EngineDead(reason)))
                code = 1
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.outbound.put(None)
            await asyncio.wait_for(writer, timeout=5)
            out_sock.close()
            self.engine.shutdown()
            self.ctx.term()
        return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = msgspec.json.decode(argv[0].encode(), type=EngineProcArgs)
    logging.basicConfig(level=args.log_level, format="%(asctime)s engine %(levelname)s %(message)s")
    # Before vLLM is imported (its environment is read once): the hooks are written against
    # vLLM's V1 model runner, which 0.32 still ships beside the default V2 one on CUDA.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    try:
        version = require_vllm()
    except VllmUnavailable as e:  # the front end prints the reason as its one line
        _report_dead(args.output_addr, str(e))
        return 1
    log.info("vLLM %s", version)
    if args.process.cpu_threads:
        import torch

        torch.set_num_threads(args.process.cpu_threads)  # the codec stage, in this process
    return asyncio.run(VllmEngineLoop(args).run())


if __name__ == "__main__":
    sys.exit(main())
