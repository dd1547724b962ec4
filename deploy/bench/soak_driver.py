"""The soak's driver: references first, then sessions of the mix at the configured
concurrency, the stalled-reader duty cycle, the RSS curve and the end-of-run engine check
(deploy/bench/soak.py)."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from deploy.bench.soak_report import summarize
from deploy.bench.soak_server import (
    GEN_POOL,
    SPEECH_POOL,
    STALL_HIDDEN,
    STALL_SPEECH,
    WAIT_S,
    Outcome,
    rss_mb,
)
from deploy.bench.soak_sessions import Refused, SessionFailed, SoakClients


class Soak(SoakClients):
    async def stall_schedule(self, done: asyncio.Event) -> None:
        """Heavy requests on a duty cycle, alternately stalled and read (the control), so the
        others' TTFA while a reader stalls is compared with the same work read normally: the
        long prompt's prefill costs everyone the same either way; a stall must cost nothing."""
        tasks = []
        reads = False
        while True:
            try:
                await asyncio.wait_for(done.wait(), self.cfg.stall_every_s / 2)
                break
            except asyncio.TimeoutError:
                pass
            for path, messages in (STALL_SPEECH, STALL_HIDDEN):
                tasks.append(asyncio.create_task(self.one(
                    "heavy_read" if reads else "stall", lambda o, p=path, m=messages, r=reads: self.stall(o, p, m, r))))
            reads = not reads
            try:
                await asyncio.wait_for(done.wait(), self.cfg.stall_every_s / 2)
                break
            except asyncio.TimeoutError:
                pass
        await asyncio.gather(*tasks)

    async def one(self, kind: str, run=None) -> None:
        o = Outcome(kind, time.monotonic())
        try:
            await asyncio.wait_for((run or getattr(self, f"kind_{kind}"))(o), WAIT_S + self.cfg.stall_s + self.cfg.idle_s)
            o.ok = True
        except Refused as e:
            o.refused, o.error = True, f"refused: {e}"[:300]
        except (SessionFailed, aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError, KeyError) as e:
            o.error = f"{type(e).__name__}: {e}"[:300]
        o.ended = time.monotonic()
        self.outcomes.append(o)

    async def references(self) -> None:
        """Every pooled request run alone once per protocol: the order / exactly-once oracle."""
        for item in SPEECH_POOL:
            o = Outcome("ref", time.monotonic())
            self.ref_speech[("ws", item[0])] = await self.speech_ws(o, item)
            self.ref_speech[("http", item[0])] = await self.speech_http(o, item)
        for item in GEN_POOL:
            o = Outcome("ref", time.monotonic())
            self.ref_tokens[tuple(item[0]) + (item[1], item[2])] = await self.generate_ws(o, item)

    async def sample_rss(self, stop: asyncio.Event, curve: list) -> None:
        front, engine = self.server.proc.pid, self.server.engine_pid()
        t0 = time.monotonic()
        while not stop.is_set():
            curve.append((round(time.monotonic() - t0, 1), rss_mb(front), rss_mb(engine), len(self.outcomes)))
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.sample_s)
            except asyncio.TimeoutError:
                pass

    async def engine_idle(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            async with self.http.get(self.server.base_url + "/v1/engine/stats") as r:
                stats = await r.json()
            idle = (stats["num_running"] == stats["num_waiting"] == 0 and stats["active_request_ids"] == []
                    and stats["num_free_blocks"] == stats["num_total_blocks"] and stats.get("num_codec_streams", 0) == 0)
            if idle or time.monotonic() > deadline:
                return stats | {"idle": idle}
            await asyncio.sleep(0.25)

    async def run(self) -> dict:
        cfg = self.cfg
        kinds, weights = zip(*[(k, w) for k, w in cfg.mix.items() if w > 0])
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=WAIT_S)) as self.http:
            await self.references()
            curve: list = []
            stop = asyncio.Event()
            sampler = asyncio.create_task(self.sample_rss(stop, curve))
            running: set[asyncio.Task] = set()
            load_done = asyncio.Event()
            stallers = asyncio.create_task(self.stall_schedule(load_done))
            t0 = time.monotonic()
            started = 0
            while started < cfg.sessions and time.monotonic() - t0 < cfg.duration_s:
                while len(running) >= cfg.concurrency:
                    _, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                running.add(asyncio.create_task(self.one(self.rng.choices(kinds, weights)[0])))
                started += 1
            load_done.set()
            await asyncio.gather(*running, stallers)
            wall = time.monotonic() - t0
            # the engine idle first, then two more samples: retained growth is judged on a settled
            # process, not inside the last stalled reader's transient (its working set drains within
            # seconds; a sample taken in it read as growth)
            final = await self.engine_idle()
            await asyncio.sleep(2 * cfg.sample_s)
            stop.set()
            await sampler
        self.zctx.destroy(0)
        return summarize(cfg, self.outcomes, curve, final, wall, self.stall_windows, self.control_windows)
