"""deploy/bench/common.served, the server life of the serving, csm and dp benchmarks, on a stub
server (a few lines of http.server run with `sys.executable -c`): it comes up on a free port,
its URL answers, a stop leaves nothing of its session running; an early exit or a passed
deadline raises with the log's tail."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from deploy.bench.common import free_port, http_json, served

# Called as `python -c STUB --port PORT MODE` (the command `served` builds): MODE ok serves
# {"status": "ok", "child": pid of a sleeper it started in its session}; degraded serves
# {"status": "degraded"}; stubborn ignores SIGTERM and serves ok; exit prints and exits 3;
# silent never listens.
STUB = r"""
import json, os, signal, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

port, mode = int(sys.argv[sys.argv.index("--port") + 1]), sys.argv[-1]
print(f"stub {mode} on port {port}, pid {os.getpid()}", flush=True)
if mode == "exit":
    print("stub gives up: no model here", flush=True)
    sys.exit(3)
if mode == "silent":
    time.sleep(60)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
body = json.dumps({"status": "degraded" if mode == "degraded" else "ok", "child": child.pid}).encode()


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)


HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""
PROGRAM = (sys.executable, "-c", STUB)


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie nobody reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def gone(pid: int, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_comes_up_answers_and_leaves_nothing_running(tmp_path: Path) -> None:
    with served(["ok"], tmp_path / "logs" / "server.log", program=PROGRAM, timeout_s=10) as srv:
        assert srv.url == f"http://127.0.0.1:{srv.port}"
        status, health = http_json(srv.url + "/health")
        assert (status, health["status"]) == (200, "ok")
        assert http_json(srv.url + "/nothing")[0] == 404
        child = health["child"]
        assert srv.proc.poll() is None and running(child)
        assert 0 <= srv.up_s < 10
    assert srv.proc.returncode == -signal.SIGTERM
    # the stub's child was not stopped by the stub: the SIGKILL to the session ends it
    assert gone(child), "a process left in the server's session outlived it"
    assert f"stub ok on port {srv.port}, pid {srv.proc.pid}" in (tmp_path / "logs" / "server.log").read_text()


def test_the_caller_port_and_ready_predicate(tmp_path: Path) -> None:
    port = free_port()
    with served(["ok"], tmp_path / "server.log", port=port, program=PROGRAM, timeout_s=10,
                ready=lambda health: health.get("status") == "ok") as srv:
        assert srv.port == port and http_json(f"http://127.0.0.1:{port}/health")[0] == 200


def test_a_server_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    with served(["stubborn"], tmp_path / "server.log", program=PROGRAM, timeout_s=10, stop_s=0.5) as srv:
        child = http_json(srv.url + "/health")[1]["child"]
    assert srv.proc.returncode == -signal.SIGKILL
    assert gone(child)


def test_an_early_exit_raises_with_the_log_tail(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="code 3") as err:
        with served(["exit"], tmp_path / "server.log", program=PROGRAM, timeout_s=10):
            pytest.fail("the block ran without a server")
    assert "stub gives up: no model here" in str(err.value)


def test_a_passed_deadline_raises_and_stops_it(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="not ready within 1 s") as err:
        with served(["silent"], tmp_path / "server.log", program=PROGRAM, timeout_s=1, stop_s=2):
            pytest.fail("the block ran without a server")
    assert time.monotonic() - t0 < 5
    tail = str(err.value)
    assert "stub silent on port" in tail
    assert gone(int(tail.rsplit("pid ", 1)[1].split()[0]))


def test_never_ready_is_a_passed_deadline(tmp_path: Path) -> None:
    # up and answering 200, but /health says degraded: dp waits for every engine ("ok")
    with pytest.raises(RuntimeError, match="not ready within 1 s"):
        with served(["degraded"], tmp_path / "server.log", program=PROGRAM, timeout_s=1,
                    ready=lambda health: health.get("status") == "ok"):
            pytest.fail("ready while degraded")

