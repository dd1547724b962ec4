"""End to end, serving: concurrent streams, client disconnects, `omnistream client` and
`omnistream bench` against the real server."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.helpers import (
    FRAME_BYTES,
    LONG_SEED,
    SAMPLE_RATE,
    WAIT_S,
    max_lsb_diff,
    speak_http,
    stats,
)
from tests.support.server_proc import ServerProc

pytestmark = pytest.mark.e2e


# ---- concurrency, disconnects --------------------------------------------------------------------


async def test_32_concurrent_streams_equal_their_solo_runs(server: ServerProc):
    n, max_new = 32, 70
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=4 * WAIT_S)) as http:
        together = await asyncio.gather(*(speak_http(http, server, 100 + i, max_new) for i in range(n)))
        for pcm in together:
            assert len(pcm) % FRAME_BYTES == 0 and len(pcm) <= (max_new // 7) * FRAME_BYTES
        assert sum(map(len, together)) > 0
        # Different seeds -> different audio (a mixed-up routing would show as equal streams).
        assert len({pcm for pcm in together if pcm}) == len([pcm for pcm in together if pcm])
        for i in (0, 9, 20, 31):
            alone = await speak_http(http, server, 100 + i, max_new)
            assert len(alone) == len(together[i]), f"stream {i}: {len(together[i])} bytes together, {len(alone)} alone"
            assert max_lsb_diff(alone, together[i]) <= 1, f"stream {i} differs from its solo run"


async def wait_for_idle_engine(http: aiohttp.ClientSession, server: ServerProc, aborted_before: int) -> dict:
    deadline = time.monotonic() + WAIT_S
    s: dict = {}
    while time.monotonic() < deadline:
        s = await stats(http, server)
        if (not s["active_request_ids"] and s["num_running"] == 0 and s["num_waiting"] == 0
                and s["num_free_blocks"] == s["num_total_blocks"] and s["num_aborted_total"] > aborted_before):
            return s
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine did not abort and free the request: {s}")


async def test_client_disconnect_aborts_request(server: ServerProc):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
        before = await stats(http, server)
        body = {"input": "Hello there.", "response_format": "pcm", "seed": LONG_SEED, "max_new_tokens": 700}
        r = await http.post(server.base_url + "/v1/audio/speech", json=body)
        assert r.status == 200
        first = await r.content.readany()
        assert len(first) > 0
        during = await stats(http, server)
        assert len(during["active_request_ids"]) == 1 and during["num_running"] == 1, during
        r.close()  # drop the connection mid-stream
        after = await wait_for_idle_engine(http, server, before["num_aborted_total"])
        assert after["num_requests_total"] == before["num_requests_total"] + 1
        assert after["num_generated_tokens_total"] - before["num_generated_tokens_total"] < 700


# ---- omnistream client ---------------------------------------------------------------------------


def test_cli_client_speak_and_ws_write_wav(server: ServerProc, tmp_path: Path):
    import wave

    from server.cli import main

    for mode in ("speak", "ws"):
        out = tmp_path / f"{mode}.wav"
        rc = main(["client", mode, "Hello there.", "--url", server.base_url, "-o", str(out), "--max-tokens", "35"])
        assert rc == 0
        with wave.open(str(out)) as w:  # a complete file: the header sizes match the data
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SAMPLE_RATE, 1, 2)
            frames = w.getnframes() if mode == "ws" else (out.stat().st_size - 44) // 2
            assert frames > 0 and frames % 2048 == 0




def test_cli_client_reports_server_errors(server: ServerProc, tmp_path: Path, capsys):
    from server.cli import main

    rc = main(["client", "speak", "Hello", "--voice", "nobody", "--url", server.base_url, "-o", str(tmp_path / "x.wav")])
    assert rc == 1
    assert "param=voice" in capsys.readouterr().err


# ---- omnistream bench -----------------------------------------------------------------------------


def test_bench_player_counts_underruns():
    from server.bench import Player

    p = Player(sample_rate=24000)
    p.arrive(10.0, 48000)  # 1 s of audio; playback starts now
    p.arrive(10.9, 24000)  # due at 11.0: in time
    p.arrive(11.7, 24000)  # due at 11.5: 0.2 s late -> one underrun, the player stalls
    p.arrive(12.1, 24000)  # due at 12.0 + 0.2 stall = 12.2: in time
    assert p.underruns == 1 and p.stall_s == pytest.approx(0.2)
    assert p.received_s == pytest.approx(2.5)


async def test_bench_level_against_the_server(server: ServerProc):
    from server.bench import bench, render

    reports = []  # the results so far after each level (what --out is rewritten with)
    t0 = time.perf_counter()
    results = await bench(server.base_url, [1, 2], "Hello there. How are you?", 35, ramps=[0.4],
                          report=lambda rs: reports.append([lv.n for lv in rs]))
    assert reports == [[1], [1, 2]]
    lv = results[-1]
    assert time.perf_counter() - t0 >= 0.2  # the second stream started half the ramp later
    assert not lv.timed_out and lv.errors == []
    for s in lv.streams:
        assert s.utterances == 2 and s.chunks > 0 and s.ttfa_s is not None and 0 < s.ttfa_s <= s.gen_s
        assert s.audio_s > 0 and round(s.audio_s * SAMPLE_RATE * 2) % FRAME_BYTES == 0
    table = render([lv], {"date": "today"})
    assert "| 2 | 0.4 |" in table and "Largest N" in table and "starts spread evenly over 0.4 s" in table
    # the front end settled its heap at start-up (server/gc_tuning.py) and watches its collections
    async with aiohttp.ClientSession() as http:
        async with http.get(server.base_url + "/metrics") as r:
            text = await r.text()
    full = re.search(r'omnistream_gc_pause_seconds_count\{generation="2"\} (\S+)', text)
    assert full and float(full.group(1)) >= 1, "the settling full collection was not observed"
