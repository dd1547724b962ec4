"""The front end's share of time to first audio when many TTS sessions start at once (no GPU).

The real server app (aiohttp handlers, text segmenter, tokenizer, Speaker, metrics) runs in its
own process on an engine that answers at once (tests/support/fake_engine.py: first audio 1 ms after a
request, then an 85 ms chunk every `--chunk-ms`, about the real server's pace at 400 streams),
and `omnistream bench` (the same client as the GPU serving benchmark, another process) starts N
WebSocket sessions together. Per level it reports the client's TTFA, the server's own (text
segment queued -> first audio byte sent, from the /metrics histogram, so bucket bounds) and the
server's garbage-collection pauses during the level (count and total, from /metrics). The server
settles its heap as `serve` does (server/gc_tuning.py); `--gc-thresholds 700,10,10` runs it with
Python's default thresholds instead. With a real engine these milliseconds come on top of the
engine's time to first audio (docs/performance.md has the figures).

    python -m deploy.bench.frontend --streams 1,100,400
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from server.gc_tuning import FRONT_END_GC_THRESHOLDS

TEXT = "Hello there, this is one sentence of streaming speech for the benchmark."
_TTFA = re.compile(r'omnistream_time_to_first_audio_seconds_bucket\{endpoint="/v1/audio/speech/stream",le="([^"]+)"\} (\S+)')
_GC = re.compile(r'omnistream_gc_pause_seconds_(count|sum)\{generation="\d"\} (\S+)')


def serve(url_file: str, chunk_ms: float, chunks: int, gc_thresholds: tuple[int, int, int]) -> None:
    """The app on the fake engine until killed (uvloop when installed, heap settled: as `serve` runs)."""
    import server.main  # noqa: F401  (the real front end's modules, in the heap that gets frozen)
    from server.gc_tuning import settle_heap
    from tests.support.fake_engine import FakeEngine
    from tests.support.fake_engine import serve as serve_app

    async def run() -> None:
        eng = FakeEngine(steps=chunks, samples_per_step=2048, audio_from_step=0, step_delay=chunk_ms / 1e3,
                         first_delay=0.001)
        async with serve_app(eng, max_concurrent_requests=8192) as s:
            settle_heap(gc_thresholds)
            Path(url_file).write_text(s.base_url)
            await asyncio.Event().wait()

    from server.main import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory()) as r:
        r.run(run())


def server_metrics(url: str) -> tuple[dict[float, float], tuple[float, float]]:
    """Cumulative count per histogram bound (seconds) of the server-side TTFA, and the server's
    (collections, seconds paused) so far, all generations."""
    body = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    gc_totals = {"count": 0.0, "sum": 0.0}
    for kind, v in _GC.findall(body):
        gc_totals[kind] += float(v)
    return {float(le): float(v) for le, v in _TTFA.findall(body)}, (gc_totals["count"], gc_totals["sum"])


def quantile_bound(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Upper bound (ms) of the bucket holding quantile q of the observations between two reads."""
    bounds = sorted(after)
    delta = [after[b] - before.get(b, 0.0) for b in bounds]
    total = delta[-1]
    for b, c in zip(bounds, delta):
        if total and c >= q * total:
            return b * 1e3
    return float("nan")


def main() -> int:
    # the server process (--serve) does not import this: it keeps torch out of the front end's heap
    from deploy.bench.common import ROOT, add_out_arg

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,100,400")
    ap.add_argument("--chunk-ms", type=float, default=70.0, help="fake engine: ms between 85 ms audio chunks")
    ap.add_argument("--chunks", type=int, default=3, help="fake engine: chunks per utterance")
    ap.add_argument("--gc-thresholds", default=",".join(map(str, FRONT_END_GC_THRESHOLDS)),
                    help="the server's gc.set_threshold after start-up (700,10,10: Python's default)")
    ap.add_argument("--serve", metavar="URL_FILE", help=argparse.SUPPRESS)  # internal: the server process
    add_out_arg(ap, "frontend")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.chunk_ms, args.chunks, tuple(int(x) for x in args.gc_thresholds.split(",")))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        url_file = Path(tmp) / "url"
        srv = subprocess.Popen([sys.executable, "-m", "deploy.bench.frontend", "--serve", str(url_file),
                                "--chunk-ms", str(args.chunk_ms), "--chunks", str(args.chunks),
                                "--gc-thresholds", args.gc_thresholds], cwd=ROOT)
        try:
            t0 = time.time()
            while not url_file.exists() or not url_file.read_text():
                if srv.poll() is not None or time.time() - t0 > 60:
                    raise RuntimeError("the front end did not start")
                time.sleep(0.2)
            url = url_file.read_text()
            lines = [f"gc thresholds {args.gc_thresholds}",
                     "| sessions starting together | client TTFA p50 / p99 ms | server TTFA p50 / p99 ms (bucket bound) "
                     "| server GC pauses: count / total ms |",
                     "| ---: | --- | --- | --- |"]
            print("\n".join(lines))
            for n in (int(x) for x in args.streams.split(",")):
                before, gc_before = server_metrics(url)
                report = subprocess.run([sys.executable, "-m", "server.cli", "bench", "--url", url, "--streams", str(n),
                                         "--max-tokens", "60", "--ramp-s", "0", "--text", TEXT], cwd=ROOT, check=True,
                                        capture_output=True, text=True).stdout
                after, gc_after = server_metrics(url)
                row = next(line for line in report.splitlines() if line.startswith(f"| {n} | 0 |")).split("|")
                # the warm-up session of `bench` is in the server's histogram too: one in n + 1
                lines.append(f"| {n} | {row[3].strip()} / {row[4].strip()} | "
                             f"{quantile_bound(before, after, 0.5):.0f} / {quantile_bound(before, after, 0.99):.0f} | "
                             f"{gc_after[0] - gc_before[0]:.0f} / {(gc_after[1] - gc_before[1]) * 1e3:.0f} |")
                print(lines[-1], flush=True)
        finally:
            srv.terminate()
            srv.wait(10)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
