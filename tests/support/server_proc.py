"""Start and stop a REAL omnistream server process for end-to-end tests.

The server runs as `python -m server.cli serve` on free loopback ports, builds the embedded
tiny default model into a private cache dir and is always stopped (SIGTERM, then SIGKILL,
including the engine child it spawned) even when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tests/support/server_proc.py -> the repository root
READY_TIMEOUT_S = 180.0  # the CPU is shared with other jobs; start-up is ~2 s when idle
STOP_GRACE_S = 15.0


def free_port() -> int:
    """A loopback port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Direct children of a process (Linux /proc; no psutil needed)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended while we looked
    return kids


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except FileNotFoundError:
        return []


def http_get(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    """(status, JSON body) of a GET; connection failures raise OSError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        body = e.read()
        return e.code, json.loads(body) if body else {}


@dataclass
class ServerProc:
    proc: subprocess.Popen
    http_port: int
    zmq_port: int
    cache_dir: Path
    log_path: Path
    _log_file: object = field(repr=False, default=None)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.http_port}"

    @property
    def zmq_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    def output(self, tail_chars: int = 8000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "<no output>"
        return text[-tail_chars:]

    def engine_pid(self) -> int | None:
        """The engine child (`python -m runner.engine.process ...`) of the server process."""
        for pid in children(self.proc.pid):
            if "runner.engine.process" in cmdline(pid):
                return pid
        return None

    def health(self, timeout: float = 2.0) -> int:
        """/health status code, or 0 when the server does not answer."""
        try:
            return http_get(self.base_url + "/health", timeout)[0]
        except OSError:
            return 0

    def wait_healthy(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} before it was ready:\n{self.output()}")
            if self.health() == 200:
                return
            time.sleep(0.1)
        raise RuntimeError(f"server not healthy within {timeout:.0f} s:\n{self.output()}")

    def stop(self) -> None:
        """SIGTERM (the server stops its engine), then SIGKILL whatever is left of the tree."""
        tree = [self.proc.pid, *children(self.proc.pid)]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in tree[1:]:  # an engine orphaned by a killed server would idle forever
            if Path(f"/proc/{pid}").exists() and "runner.engine.process" in cmdline(pid):
                os.kill(pid, signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()


def start_server(workdir: Path, *extra_args: str, timeout: float = READY_TIMEOUT_S) -> ServerProc:
    """Start the real server and wait until /health says ok. Raises with the server's output
    when it does not come up; the process is stopped in that case too."""
    workdir.mkdir(parents=True, exist_ok=True)
    http_port, zmq_port = free_port(), free_port()
    while zmq_port == http_port:
        zmq_port = free_port()
    cache_dir = workdir / "cache"
    log_path = workdir / "server.log"
    log_file = open(log_path, "wb")
    # One intra-op thread: the tiny model gains nothing from more, and spinning OpenMP workers
    # slow everything down badly on a small shared CPU.
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "server.cli", "serve",
        "--port", str(http_port),
        "--zmq-endpoint", f"tcp://127.0.0.1:{zmq_port}",
        "--cache-dir", str(cache_dir),
        "--device", "cpu",
        *extra_args,
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT)
    server = ServerProc(proc, http_port, zmq_port, cache_dir, log_path, log_file)
    try:
        server.wait_healthy(timeout)
    except BaseException:
        server.stop()
        raise
    return server
