"""`omnistream bench`: N concurrent WebSocket TTS sessions, each read by a real-time player.

For each concurrency level N, N sessions on /v1/audio/speech/stream are opened and configured,
then each sends the same text (seeded, one seed per stream) and reads the audio as a player would: playback starts at the
first audio byte and then consumes audio at real-time speed. A chunk that arrives after
playback has reached it is an underrun (the player stalls until it arrives). Per level:

  TTFA      time from sending the text to the first audio byte (p50 / p99 over streams)
  RTF       generation time / audio duration per stream (< 1 is faster than real time)
  chunks/s  binary audio frames per second, all streams together
  underruns stalls of the real-time players (and how many streams had one)

and, over all levels, the largest N with no underrun and TTFA p99 < 300 ms. Without --url
the real server is started on the embedded default model (a tiny random model: on a CPU this
measures the front end and engine loop, not a real model's speed).

The server may cut the text into several utterances (sentence segmentation); a stream plays
them back to back, as a client would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

SAMPLE_BYTES = 2  # s16le mono
TTFA_TARGET_S = 0.300
LEVEL_TIMEOUT_S = 180.0  # one concurrency level may not run longer than this
STARTUP_TIMEOUT_S = 300.0
BASE_SEED = 1000


@dataclass
class StreamResult:
    ttfa_s: float | None = None
    gen_s: float = 0.0  # text sent -> last audio byte
    audio_s: float = 0.0
    chunks: int = 0
    utterances: int = 0
    underruns: int = 0
    stall_s: float = 0.0
    error: str | None = None
    error_at: float | None = None  # perf_counter() when the error event arrived (deploy/bench/dp.py)

    @property
    def rtf(self) -> float | None:
        return self.gen_s / self.audio_s if self.audio_s > 0 else None


@dataclass
class LevelResult:
    n: int
    streams: list[StreamResult]
    wall_s: float
    timed_out: bool = False
    ramp_s: float = 0.0  # stream starts spread evenly over this many seconds (0: together)

    @property
    def errors(self) -> list[str]:
        return [s.error for s in self.streams if s.error]

    @property
    def ttfas(self) -> list[float]:
        return [s.ttfa_s for s in self.streams if s.ttfa_s is not None]

    @property
    def underruns(self) -> int:
        return sum(s.underruns for s in self.streams)

    @property
    def real_time(self) -> bool:
        """Every stream completed with audio, no underrun, TTFA p99 under target."""
        complete = not self.timed_out and not self.errors and len(self.ttfas) == self.n
        return complete and self.underruns == 0 and percentile(self.ttfas, 99) < TTFA_TARGET_S


@dataclass
class Player:
    """Virtual real-time playback clock of one stream."""

    sample_rate: int
    started_at: float | None = None
    received_s: float = 0.0  # audio received so far, in seconds
    underruns: int = 0
    stall_s: float = 0.0

    def arrive(self, now: float, nbytes: int) -> None:
        if self.started_at is None:
            self.started_at = now
        else:
            # playback reaches the start of this chunk after everything before it has played
            due = self.started_at + self.received_s + self.stall_s
            if now > due:
                self.underruns += 1
                self.stall_s += now - due
        self.received_s += nbytes / SAMPLE_BYTES / self.sample_rate


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (with few streams, p99 is the worst one)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# ---- one stream, one level -----------------------------------------------------------------------


async def connect_stream(http: aiohttp.ClientSession, ws_url: str, max_tokens: int, seed: int
                         ) -> tuple[aiohttp.ClientWebSocketResponse, Player]:
    """Open and configure one session (not timed: TTFA starts when the text is sent)."""
    ws = await http.ws_connect(ws_url + "/v1/audio/speech/stream", max_msg_size=0)
    try:
        created = await ws.receive_json()
        await ws.send_json({"type": "session.config", "max_new_tokens": max_tokens, "seed": seed})
    except BaseException:
        await ws.close()
        raise
    return ws, Player(int(created.get("session", {}).get("sample_rate", 24000)))


async def run_stream(ws: aiohttp.ClientWebSocketResponse, player: Player, text: str, delay_s: float = 0.0) -> StreamResult:
    res = StreamResult()
    try:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        sent = time.perf_counter()
        await ws.send_json({"type": "input.text", "text": text})
        await ws.send_json({"type": "session.close"})  # speak everything, then session.done
        async for msg in ws:
            now = time.perf_counter()
            if msg.type is aiohttp.WSMsgType.BINARY:
                if res.ttfa_s is None:
                    res.ttfa_s = now - sent
                player.arrive(now, len(msg.data))
                res.chunks += 1
                res.gen_s = now - sent
            elif msg.type is aiohttp.WSMsgType.TEXT:
                event = json.loads(msg.data)
                kind = event.get("type")
                if kind == "audio.done":
                    res.utterances += 1
                elif kind == "error":
                    res.error, res.error_at = f"{event.get('code')}: {event.get('message')}", now
                elif kind == "session.done":
                    break
            else:
                res.error = res.error or f"connection closed before session.done ({msg.type.name})"
                break
    finally:
        await ws.close()
    res.audio_s, res.underruns, res.stall_s = player.received_s, player.underruns, player.stall_s
    return res


async def run_level(base_url: str, n: int, text: str, max_tokens: int, timeout_s: float, ramp_s: float = 0.0) -> LevelResult:
    """n sessions, all connected and configured first; then stream i sends its text
    i * ramp_s / n seconds after the first (0: all at once). Connecting first keeps the
    client's own n handshakes (and the server's) out of the timed part: a client busy with
    hundreds of handshakes would otherwise stamp the first audio late."""
    ws_url = base_url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap on concurrent sessions
    async with aiohttp.ClientSession(connector=connector) as http:
        conns = await asyncio.wait_for(
            asyncio.gather(*(connect_stream(http, ws_url, max_tokens, BASE_SEED + i) for i in range(n)),
                           return_exceptions=True), timeout_s)
        tasks: list[asyncio.Task | None] = [
            None if isinstance(c, BaseException) else asyncio.create_task(run_stream(*c, text, i * ramp_s / n))
            for i, c in enumerate(conns)]
        t0 = time.perf_counter()
        live = [t for t in tasks if t is not None]
        done, pending = await asyncio.wait(live, timeout=timeout_s + ramp_s) if live else (set(), set())
        wall = time.perf_counter() - t0
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    streams = []
    for c, t in zip(conns, tasks):
        if t is None:
            streams.append(StreamResult(error=f"connect: {type(c).__name__}: {c}"))
        elif t in pending:
            streams.append(StreamResult(error="did not finish within the level's time limit"))
        elif t.exception() is not None:
            streams.append(StreamResult(error=f"{type(t.exception()).__name__}: {t.exception()}"))
        else:
            streams.append(t.result())
    return LevelResult(n, streams, wall, timed_out=bool(pending), ramp_s=ramp_s)


# ---- the server under test ---------------------------------------------------------------------


class LocalServer:
    """The real server on the embedded default, in a subprocess, stopped on exit."""

    def __init__(self, max_streams: int):
        self.max_streams = max_streams
        self.tmp = Path(tempfile.mkdtemp(prefix="omnistream-bench-"))
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> "LocalServer":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        # Each session may have an utterance in flight and one prefetched: 2 rows per stream.
        cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--zmq-endpoint", "none",
               "--cache-dir", str(self.tmp / "cache"), "--max-num-seqs", str(max(64, 2 * self.max_streams)),
               "--max-concurrent-requests", str(max(256, 2 * self.max_streams)), "--log-level", "WARNING"]
        self.log = open(self.tmp / "server.log", "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self._output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet
            time.sleep(0.2)
        raise RuntimeError(f"server not ready within {STARTUP_TIMEOUT_S:.0f} s:\n{self._output()}")

    def _output(self) -> str:
        return (self.tmp / "server.log").read_text(errors="replace")[-4000:]

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


# ---- report ------------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{cpu}, {os.cpu_count()} CPU threads, {platform.system()} {platform.release()}"
    if shutil.which("nvidia-smi"):
        try:
            gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=10).stdout.split("\n")
            gpus = [g.strip() for g in gpus if g.strip()]
            if gpus:
                desc += f"; GPU: {len(gpus)} x {gpus[0]}"
        except (OSError, subprocess.TimeoutExpired):
            pass
    return desc


def _ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v * 1000:.0f}"


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None or math.isnan(v) else fmt.format(v)


def render(levels: list[LevelResult], meta: dict[str, str]) -> str:
    lines = ["## omnistream serving benchmark", "", *(f"- {k}: {v}" for k, v in meta.items()), "",
        "| streams | starts spread over s | TTFA p50 ms | TTFA p99 ms | RTF p50 | RTF max | chunks/s | audio s/stream "
        "| utterances/stream | underruns (streams) | stall ms (worst stream) | errors | real time |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for lv in levels:
        rtfs = [s.rtf for s in lv.streams if s.rtf is not None]
        chunks = sum(s.chunks for s in lv.streams)
        audio = [s.audio_s for s in lv.streams]
        with_underrun = sum(1 for s in lv.streams if s.underruns)
        lines.append(
            f"| {lv.n} | {lv.ramp_s:g} | {_ms(percentile(lv.ttfas, 50))} | {_ms(percentile(lv.ttfas, 99))} "
            f"| {_num(percentile(rtfs, 50))} | {_num(max(rtfs) if rtfs else None)} "
            f"| {_num(chunks / lv.wall_s if lv.wall_s > 0 else None, '{:.1f}')} "
            f"| {_num(sum(audio) / len(audio) if audio else None)} "
            f"| {_num(sum(s.utterances for s in lv.streams) / lv.n, '{:.1f}')} "
            f"| {lv.underruns} ({with_underrun}) | {_ms(max((s.stall_s for s in lv.streams), default=math.nan))} "
            f"| {len(lv.errors)} | {'yes' if lv.real_time else 'no'} |"
        )
    for ramp in sorted({lv.ramp_s for lv in levels}):
        ok = [lv.n for lv in levels if lv.real_time and lv.ramp_s == ramp]
        how = "all streams starting together" if ramp == 0 else f"starts spread evenly over {ramp:g} s"
        lines += ["", f"Largest N with no underrun and TTFA p99 < {TTFA_TARGET_S * 1000:.0f} ms ({how}): "
                      f"{max(ok) if ok else 'none of the levels run'}"]
    errors = sorted({e for lv in levels for e in lv.errors})
    if errors:
        lines += ["", "Errors: " + "; ".join(errors[:5])]
    return "\n".join(lines) + "\n"


# ---- entry point -------------------------------------------------------------------------------


def parse_levels(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--streams: expected comma-separated integers, got {spec!r}") from None
    if not levels or any(n < 1 for n in levels):
        raise SystemExit(f"--streams: every level must be >= 1, got {spec!r}")
    return levels


async def bench(url: str, levels: list[int], text: str, max_tokens: int, ramps: list[float] = (0.0,),
                report: Callable[[list[LevelResult]], None] | None = None) -> list[LevelResult]:
    """The levels (each ramp, each N); `report` gets the results so far after each level."""
    # Warm-up (first codec call, allocator, prefix cache): not recorded.
    await run_level(url, 1, text, max_tokens, LEVEL_TIMEOUT_S)
    results = []
    for ramp, n in [(r, n) for r in ramps for n in levels]:
        lv = await run_level(url, n, text, max_tokens, LEVEL_TIMEOUT_S, ramp)
        print(f"  {n} streams: {lv.wall_s:.1f} s, TTFA p99 {_ms(percentile(lv.ttfas, 99))} ms, "
              f"underruns {lv.underruns}, errors {len(lv.errors)}", file=sys.stderr)
        results.append(lv)
        if report is not None:
            report(results)
    return results


def run_bench(args: argparse.Namespace) -> int:
    levels = parse_levels(args.streams)
    try:
        ramps = [float(x) for x in str(args.ramp_s).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--ramp-s: expected comma-separated seconds, got {args.ramp_s!r}") from None
    if not ramps or any(r < 0 or math.isnan(r) for r in ramps):
        raise SystemExit(f"--ramp-s: every value must be >= 0, got {args.ramp_s!r}")
    if args.max_tokens < 1:
        raise SystemExit("--max-tokens: must be >= 1")
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": " ".join(["omnistream", *sys.argv[1:]]) if sys.argv[0].endswith("omnistream") else " ".join(sys.argv),
        "server": args.url or "embedded default (tiny random-weight model), started by the benchmark",
        "workload": f"{args.text!r}, max_new_tokens={args.max_tokens}, seed {BASE_SEED}+i per stream, "
                    "WebSocket /v1/audio/speech/stream, real-time player per stream",
    }
    threads = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}
    if threads:  # CPU figures depend on them (a started server inherits them)
        meta["env"] = ", ".join(f"{k}={v}" for k, v in threads.items())
    try:
        meta["load average at start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    def write(results: list[LevelResult]) -> None:  # after every level: a server that stalls later keeps these
        if args.out:
            Path(args.out).write_text(render(results, meta))

    if args.url:
        results = asyncio.run(bench(args.url.rstrip("/"), levels, args.text, args.max_tokens, ramps, write))
    else:
        print("starting the server on the embedded default model ...", file=sys.stderr)
        with LocalServer(max(levels)) as srv:
            results = asyncio.run(bench(srv.url, levels, args.text, args.max_tokens, ramps, write))
    print(render(results, meta))
    return 0
