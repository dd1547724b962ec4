"""The engine process: one per device, started by the server as a child (`python -m
runner.engine.process ARGS_JSON`), talking ZeroMQ.

Threads:
  input thread   PULL socket -> decode -> inbound queue (so IPC never waits on the GPU)
  busy loop      (main thread) apply inbound messages, step the engine, hand outputs over
  output thread  outputs -> multipart msgpack frames -> PUSH socket

A ready handshake (`Ready`) is sent after the model, KV cache and codec are loaded. SIGTERM /
SIGINT stop the loop cleanly; a crash in the loop is reported as `EngineDead` before exiting.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback

import msgspec
import numpy as np
import torch
import zmq

from runner.config import EngineConfig, parse_dtype
from runner.engine.args import EngineProcArgs
from runner.engine.compile_log import install
from runner.engine.engine import Engine, EngineBusy
from runner.engine.watchdog import LoopWatchdog
from runner.families import family_for
from runner.layers import make_backends
from streaming import ipc
from streaming.gc_pause import freeze_startup_heap, log_slow_gc
from streaming.sampling_params import InvalidRequest

log = logging.getLogger("omnistream.engine")

SLOW_STEP_S = 0.1  # steps longer than this are logged one by one
STALL_S = 20.0  # a loop without progress for this long logs its stack (runner/engine/watchdog.py)
EXIT_STALLED = 3  # the process's exit status after giving up on a stalled loop (ProcessConfig.stall_exit_s)


def build_engine(args: EngineProcArgs):
    """Config tree -> model -> family and codec -> Engine (also used in-process by tests and
    benchmarks)."""
    cfg = EngineConfig.from_parts(args.model_path, args.cache, args.scheduler, args.runner)
    dev, proc = cfg.runner.torch_device, args.process
    if dev.type == "cpu":
        torch.set_num_threads(proc.cpu_threads or max(1, min(4, (os.cpu_count() or 2) // 2)))
    family = family_for(args.profile, args.model_path)
    codec = family.build_codec(dev, parse_dtype(proc.codec_dtype, dev), cfg.runner.tuning)
    model = None
    if proc.random_weights:  # benchmarks: config.json gives the shape, no safetensors read
        attn, ops = make_backends(cfg.runner)
        model = family.load_model(cfg, attn, ops, random_weights=True)
    return Engine(cfg, model=model, family=family, codec=codec)


class EngineLoop:
    def __init__(self, engine, ctx: zmq.Context, args: EngineProcArgs):
        self.engine = engine
        self.inbound: queue.Queue = queue.Queue()
        self.outbound: queue.Queue = queue.Queue(maxsize=1024)  # bounded: backpressure on a stuck peer
        self.stop = threading.Event()
        self.ctx = ctx
        self.args = args
        self._n, self._busy, self._batch, self._t_log = 0, 0.0, 0, time.monotonic()
        self._encode_s, self._max_step, self._max_batch = 0.0, 0.0, 0
        self._added: dict[str, float] = {}  # audio request id -> arrival (for the first-audio log)
        self._first_audio: list[float] = []

    # ---- threads ------------------------------------------------------------------------------

    def _input_thread(self) -> None:
        sock = self.ctx.socket(zmq.PULL)
        sock.connect(self.args.input_addr)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        # run() joins this thread before main() terminates the context: a poll on a terminated
        # context raises ContextTerminated (it printed a traceback on one SIGTERM in five).
        while not self.stop.is_set():
            if not poller.poll(100):
                continue
            buf = sock.recv(copy=False)
            try:
                msg = ipc.decode_inbound(buf.buffer)
            except msgspec.DecodeError as e:  # a broken peer message must not kill the engine
                log.error("dropping undecodable inbound message: %s", e)
                continue
            self.inbound.put(msg)
        sock.close(linger=0)

    def _output_thread(self, sock: zmq.Socket) -> None:
        while True:
            frames = self.outbound.get()
            if frames is None:
                break
            sock.send_multipart(frames, copy=False)

    # ---- busy loop ----------------------------------------------------------------------------

    def _apply(self, msg) -> None:
        eng = self.engine
        if isinstance(msg, ipc.AddRequest):
            if msg.audio and len(self._added) < 100_000:
                self._added[msg.request_id] = time.perf_counter()
            try:
                eng.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling, msg.hidden_state_layers, msg.audio,
                                prompt_frames=msg.prompt_frames, step_text_ids=msg.step_text_ids,
                                group_sampling=msg.group_sampling, prompt_vectors=msg.prompt_vectors,
                                step_text_open=msg.step_text_open)
            except InvalidRequest as e:
                self._added.pop(msg.request_id, None)
                out = ipc.RequestOutput(msg.request_id, finished=True, finish_reason="error", error=str(e), error_field=e.field)
                self.outbound.put(ipc.encode_outputs([out]))
            except EngineBusy as e:  # no room now: the front end answers overloaded, the engine goes on
                self._added.pop(msg.request_id, None)
                out = ipc.RequestOutput(msg.request_id, finished=True, finish_reason=ipc.FINISH_OVERLOADED, error=str(e))
                self.outbound.put(ipc.encode_outputs([out]))
        elif isinstance(msg, ipc.AppendText):
            try:
                eng.append_text(msg.request_id, msg.step_text_ids, msg.final)
            except InvalidRequest as e:  # the request ends with the error; the engine goes on
                eng.fail_request(msg.request_id, e)
        elif isinstance(msg, ipc.EncodeAudio):
            try:
                reply = eng.encode_audio(np.frombuffer(msg.pcm, dtype="<i2")).reply(msg.request_id)
            except InvalidRequest as e:
                reply = ipc.EncodedAudio(msg.request_id, error=str(e))
            self.outbound.put(ipc.encode_outbound(reply))
        elif isinstance(msg, ipc.AbortRequests):
            for rid in msg.request_ids:
                eng.abort_request(rid)
        elif isinstance(msg, ipc.GetStats):
            self.outbound.put(ipc.encode_outbound(eng.stats()))
        elif isinstance(msg, ipc.Shutdown):
            self.stop.set()

    def _give_up(self, stalled_s: float) -> None:
        """The loop is stuck in a step past ProcessConfig.stall_exit_s (the watchdog's thread):
        tell the front end (it fails the in-flight requests and restarts the engine), give the
        writer a moment to send that, and exit; the stuck thread cannot be unwound."""
        reason = f"engine loop made no progress for {stalled_s:.0f} s (stall_exit_s); exiting for a restart"
        try:
            self.outbound.put(ipc.encode_outbound(ipc.EngineDead(reason)), timeout=1.0)
        except queue.Full:
            log.error("engine: output queue full, the front end learns of the stall from the exit")
        deadline = time.monotonic() + 2.0
        while not self.outbound.empty() and time.monotonic() < deadline:
            time.sleep(0.02)
        logging.shutdown()
        os._exit(EXIT_STALLED)

    def _describe(self) -> str:
        """The loop's state for the watchdog's report (read from its thread)."""
        eng = self.engine
        gpu = eng.gpu_streams_busy()
        steps = "; ".join(f"step {n}: {sched.describe()}" for n, sched in list(eng.launched))
        return (f"{len(eng.scheduler.running)} running, {len(eng.scheduler.waiting)} waiting, "
                f"{self.outbound.qsize()} output batches queued of {self.outbound.maxsize}"
                + (f"; GPU streams: {gpu}" if gpu else "") + (f"; last launched: {steps}" if steps else ""))

    def _log_slow(self, dt: float, ph0: list[float]) -> None:
        """One line per step slower than SLOW_STEP_S: its phases and what it ran."""
        eng = self.engine
        sched = eng.last_scheduled
        phases = " ".join(f"{n} {1e3 * (v - v0):.1f}" for n, v, v0 in zip(eng.PHASES, eng.phase_s, ph0))
        log.warning("slow step %.0f ms (%s ms): %d sequences, %d decodes, %d tokens, %d running, %d waiting",
                    1e3 * dt, phases, len(sched.scheduled), sched.num_decodes, sched.num_batched_tokens,
                    len(eng.scheduler.running), len(eng.scheduler.waiting))

    def _account(self, dt: float, batch: int, outs) -> None:
        """Operator log every 5 s: steps/s, mean batch, ms per step, the host time per phase,
        the slowest step, and the engine-side time to first audio (request arrival to the
        output carrying its first PCM)."""
        self._n += 1
        self._busy += dt
        self._batch += batch
        if dt > self._max_step:
            self._max_step, self._max_batch = dt, batch
        if self._added and outs:
            now = time.perf_counter()
            for o in outs:
                if o.audio is not None or o.finished:
                    t = self._added.pop(o.request_id, None)
                    if t is not None and o.audio is not None:
                        self._first_audio.append(now - t)
        now = time.monotonic()
        if now - self._t_log >= 5.0:
            n, eng = self._n, self.engine
            phases = " ".join(f"{name} {1e3 * v / n:.2f}" for name, v in zip(eng.PHASES, eng.phase_s))
            fa = sorted(self._first_audio)
            first = f", first audio p50 {1e3 * fa[len(fa) // 2]:.0f} ms max {1e3 * fa[-1]:.0f} ms (n={len(fa)})" if fa else ""
            log.info("engine: %.0f steps/s, mean batch %.1f, %.2f ms/step (loop busy %.0f%%); host ms/step: %s encode %.2f; "
                     "slowest step %.1f ms at batch %d%s",
                     n / (now - self._t_log), self._batch / n, 1e3 * self._busy / n, 100 * self._busy / (now - self._t_log),
                     phases, 1e3 * self._encode_s / n, 1e3 * self._max_step, self._max_batch, first)
            self._n, self._busy, self._batch, self._t_log = 0, 0.0, 0, now
            self._encode_s, self._max_step, self._max_batch = 0.0, 0.0, 0
            eng.phase_s = [0.0] * len(eng.PHASES)
            self._first_audio = []

    def run(self, out_sock: zmq.Socket) -> None:
        reader = threading.Thread(target=self._input_thread, name="engine-in", daemon=True)
        reader.start()
        writer = threading.Thread(target=self._output_thread, args=(out_sock,), name="engine-out", daemon=True)
        writer.start()
        eng = self.engine
        m = eng.cfg.model
        ready = ipc.Ready(
            model=os.path.basename(os.path.normpath(m.path)),
            vocab_size=m.vocab_size,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            max_model_len=eng.cfg.scheduler.max_model_len,
            max_num_seqs=eng.cfg.scheduler.max_num_seqs,
            sample_rate=eng.codec.sample_rate if eng.codec is not None else 0,
            dtype=str(eng.cfg.runner.torch_dtype).removeprefix("torch."),
            codes_per_frame=eng.family.codes_per_frame,
            code0_penalty=eng.code0_penalty,
        )
        self.outbound.put(ipc.encode_outbound(ready))
        give_up_s = self.args.process.stall_exit_s  # 0: never; the stack report comes first either way
        report_s = min(STALL_S, give_up_s / 2) if give_up_s else STALL_S
        watchdog = LoopWatchdog(report_s, self._describe, give_up_s, self._give_up)
        try:
            while not self.stop.is_set():
                watchdog.beat()
                # block only when idle; otherwise drain without waiting
                try:
                    if not eng.has_unfinished:
                        msg = self.inbound.get(timeout=0.05)
                    elif eng.stalled_on_input:  # every request waits for text: no spinning
                        msg = self.inbound.get(timeout=0.002)
                    else:
                        msg = self.inbound.get_nowait()
                    self._apply(msg)
                    while True:
                        self._apply(self.inbound.get_nowait())
                except queue.Empty:
                    pass
                if eng.has_unfinished:
                    ph0 = list(eng.phase_s)
                    t0 = time.perf_counter()
                    outs = eng.step()
                    t1 = time.perf_counter()
                    if t1 - t0 > SLOW_STEP_S:
                        self._log_slow(t1 - t0, ph0)
                    if outs:
                        self.outbound.put(ipc.encode_outputs(outs))
                    t2 = time.perf_counter()
                    self._encode_s += t2 - t1
                    self._account(t2 - t0, len(eng.scheduler.running), outs)
        except BaseException as e:  # report, then die: the front end fails in-flight requests fast
            if not isinstance(e, KeyboardInterrupt):
                reason = "".join(traceback.format_exception_only(type(e), e)).strip()
                log.error("engine loop crashed:\n%s", traceback.format_exc())
                self.outbound.put(ipc.encode_outbound(ipc.EngineDead(reason)))
            raise
        finally:
            watchdog.close()
            self.stop.set()
            self.outbound.put(None)
            writer.join(timeout=5)
            reader.join(timeout=5)  # it closes its socket within one poll interval


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = msgspec.json.decode(argv[0].encode(), type=EngineProcArgs)
    # The busy loop, the input thread and the output thread share the GIL. With CPython's
    # default 5 ms switch interval a thread that wants the GIL can wait a whole interval, which
    # added several ms to every served engine step against the same step in-process. Hand the
    # GIL over sooner.
    sys.setswitchinterval(2e-4)
    logging.basicConfig(level=args.log_level, format="%(asctime)s engine %(levelname)s %(message)s")
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 2000)
    out_sock.connect(args.output_addr)
    try:
        engine = build_engine(args)
    except Exception as e:  # start-up failure: tell the front end why, then exit non-zero
        out_sock.send_multipart(ipc.encode_outbound(ipc.EngineDead(f"engine start-up failed: {e}")))
        log.error("start-up failed:\n%s", traceback.format_exc())
        out_sock.close()
        return 1
    if engine.device.type == "cuda":
        engine.warm_up()
    freeze_startup_heap()
    log_slow_gc(log)
    install(log)  # start-up compiles are done; any later one stalls the loop and is logged
    loop = EngineLoop(engine, ctx, args)

    def on_signal(signum, frame):
        loop.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    loop.run(out_sock)
    out_sock.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
