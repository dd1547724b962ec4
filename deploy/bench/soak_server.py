"""The soak's configuration, constants and the server under test (deploy/bench/soak.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
FRAME_SAMPLES, TOKENS_PER_FRAME = 2048, 7  # the Orpheus/SNAC layout of the embedded default
WAIT_S = 60.0
LSB_TOLERANCE = 1  # batched float noise; a misplaced chunk differs by thousands

DEFAULT_MIX = "stream=30,http=15,generate=15,zmq=10,eleven=5,disconnect=15,idle=10"
# (text, seed, max_new_tokens): short utterances, one text segment each
SPEECH_POOL = [("Hello there.", 3, 84), ("How are you today?", 5, 70), ("Soak test.", 11, 56), ("One more.", 17, 98)]
GEN_POOL = [([1, 2, 3, 4, 5], 1, 24), ([7, 9, 11], 2, 16), ([40, 41, 42, 43], 3, 32)]  # (prompt ids, seed, max_tokens)
# Stalled readers ask for more than the kernel buffers between them and the server hold (Linux
# autotunes a send buffer up to tcp_wmem's 4 MiB), so the server's writes to them really block:
# speech takes minutes of generation to get there; a generate stream with every hidden state of
# a 3,600-token prompt does it with its first frame (3600 x 3 x 128 floats on the embedded default).
STALL_TEXT = "This is a long text that a stalled reader asks for. " * 40
STALL_SPEECH = ("/v1/audio/speech/stream", [{"type": "session.config", "max_new_tokens": 1200},
                                            {"type": "input.text", "text": STALL_TEXT}, {"type": "session.close"}])
STALL_HIDDEN = ("/v1/generate/stream", [{"prompt_token_ids": [(7 * i) % 1000 for i in range(3600)],
                                         "hidden_state_layers": [0, 1, 2],
                                         "sampling": {"max_tokens": 64, "ignore_eos": True}}])


@dataclass
class Config:
    duration_s: float = 180.0
    sessions: int = 4000
    concurrency: int = 24
    mix: dict[str, float] = field(default_factory=lambda: parse_mix(DEFAULT_MIX))
    stall_every_s: float = 30.0  # a speech and a generate staller start this often ...
    stall_s: float = 8.0  # ... and stop reading for this long
    idle_s: float = 4.0
    sample_s: float = 1.0
    max_num_seqs: int = 48
    rss_growth_mb: float = 48.0
    seed: int = 0
    model: str | None = None


def parse_mix(text: str) -> dict[str, float]:
    mix = {k.strip(): float(v) for k, v in (kv.split("=") for kv in text.split(",") if kv.strip())}
    unknown = set(mix) - set(KINDS)
    if unknown:
        raise ValueError(f"--mix: unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    return mix


# ---- the server under test ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return kids


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


class Server:
    """`python -m server.cli serve` on loopback ports, its output in a log file."""

    def __init__(self, workdir: Path, max_num_seqs: int, model: str | None = None):
        workdir.mkdir(parents=True, exist_ok=True)
        self.http_port, self.zmq_port = _free_port(), _free_port()
        self.log_path = workdir / "server.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (the server's stdout for its whole life; closed in sigterm)
        cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(self.http_port),
               "--zmq-endpoint", f"tcp://127.0.0.1:{self.zmq_port}", "--cache-dir", str(workdir / "cache"),
               "--device", "cpu", "--max-num-seqs", str(max_num_seqs), *(["--model", model] if model else [])]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.ws_url = f"ws://127.0.0.1:{self.http_port}"
        self.zmq_endpoint = f"tcp://127.0.0.1:{self.zmq_port}"

    async def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.output()}")
                try:
                    async with http.get(self.base_url + "/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError(f"server not ready in {timeout:.0f} s:\n{self.output()}")

    def engine_pid(self) -> int | None:
        for pid in _children(self.proc.pid):
            try:
                if b"runner.engine.process" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except FileNotFoundError:
                continue
        return None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def sigterm(self, grace_s: float = 20.0) -> dict:
        """SIGTERM and wait: exit code, seconds to exit, traceback lines in the output."""
        tree = [self.proc.pid, *_children(self.proc.pid)]
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        took = time.monotonic() - t0
        for pid in tree[1:]:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        lines = self.output().splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
        return {"exit_code": rc, "exit_s": round(took, 2), "tracebacks": len(starts),
                "traceback_excerpts": ["\n".join(lines[max(0, i - 8):i + 20]) for i in starts]}

    def kill(self) -> None:
        if self.proc.poll() is None:
            for pid in _children(self.proc.pid):
                os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()


KINDS = ("stream", "http", "generate", "zmq", "eleven", "disconnect", "idle")  # the --mix kinds


@dataclass
class Outcome:
    kind: str
    started: float  # monotonic
    ended: float = 0.0
    ok: bool = False
    error: str = ""
    refused: bool = False
    ttfa_s: float | None = None  # first audio (speech kinds) or first token (generate kinds)
    chunks: int = 0
