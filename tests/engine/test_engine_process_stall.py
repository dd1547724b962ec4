"""The engine process gives up on a loop stuck in a step (ProcessConfig.stall_exit_s): it tells
the front end (EngineDead, which fails the in-flight requests) and exits with EXIT_STALLED, so the
server's supervisor starts a new engine (tests/e2e/test_e2e_engine_death.py covers that part).

The real process entry point, loop, watchdog and ZeroMQ sockets on the embedded default model;
only Engine.step is wrapped in the child: after its first real step it never returns (a GPU
kernel that does not end)."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import zmq

from runner.engine.args import engine_args
from runner.engine.process import EXIT_STALLED
from streaming import ipc

CHILD = """
import sys, threading
from runner.engine import process
from runner.engine.engine import Engine
real_step = Engine.step
Engine.step = lambda self: threading.Event().wait() if self.step_count else real_step(self)
sys.exit(process.main([sys.argv[1]]))
"""


def _recv(sock: zmq.Socket, timeout_s: float):
    assert sock.poll(int(timeout_s * 1000)), f"nothing from the engine in {timeout_s} s"
    return ipc.decode_outbound(sock.recv_multipart(copy=False))


def test_a_stuck_step_fails_the_requests_and_exits_for_a_restart(default_model_dir):
    ctx = zmq.Context()
    to_engine, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    in_port = to_engine.bind_to_random_port("tcp://127.0.0.1")
    out_port = from_engine.bind_to_random_port("tcp://127.0.0.1")
    args = engine_args(default_model_dir, input_addr=f"tcp://127.0.0.1:{in_port}",
                       output_addr=f"tcp://127.0.0.1:{out_port}", stall_exit_s=1.0, device="cpu")
    child = subprocess.Popen([sys.executable, "-c", CHILD, msgspec.json.encode(args).decode()],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert isinstance(_recv(from_engine, 120), ipc.Ready)
        to_engine.send(ipc.encode_inbound(ipc.AddRequest("r1", [1, 2, 3])))
        t0 = time.monotonic()
        dead = _recv(from_engine, 30)
        assert isinstance(dead, ipc.EngineDead), dead
        assert "no progress" in dead.reason and "stall_exit_s" in dead.reason
        assert child.wait(30) == EXIT_STALLED
        assert time.monotonic() - t0 < 15  # 1 s of stall, then out at once
        log = child.stdout.read().decode()
        assert "the loop is at" in log and "giving up" in log, log[-2000:]
        # the report names the steps on the device (a stalled kernel is in one of them)
        assert "last launched: step 1: 1 sequences (0 decodes, prompt chunks of 3 tokens), 3 tokens" in log, log[-2000:]
    finally:
        child.kill()
        child.wait()
        ctx.destroy(linger=0)
