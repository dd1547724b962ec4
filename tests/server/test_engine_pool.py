"""The data-parallel pool (server/engine_pool.py) over fake engines, and the engine layout
(server/engine_layout.py): routing by load, affinity, abort, death, counters, placements."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from runner.config import ConfigError
from server.engine_api import EngineUnavailable
from server.engine_layout import Placement, placements
from server.engine_pool import EnginePool, session_affinity
from streaming.ipc import AddRequest
from streaming.sampling_params import InvalidRequest
from tests.support.fake_engine import FakeEngine


def _req(rid: str) -> AddRequest:
    return AddRequest(rid, [1, 2, 3])


class _Open:
    """Streams held open after their first output (so they count as in flight)."""

    def __init__(self, pool: EnginePool):
        self.pool = pool
        self.streams: dict[str, object] = {}

    async def open(self, rid: str) -> int:
        gen = self.pool.generate(_req(rid))
        await gen.__anext__()
        self.streams[rid] = gen
        return self.pool.holder(rid)

    async def close(self, rid: str) -> None:
        await self.streams.pop(rid).aclose()

    async def close_all(self) -> None:
        for rid in list(self.streams):
            await self.close(rid)


def _engines(n: int = 2, **kw) -> list[FakeEngine]:
    return [FakeEngine(steps=1000, step_delay=0.01, **kw) for _ in range(n)]


async def test_requests_go_to_the_least_loaded_engine_and_ties_alternate():
    a, b = _engines()
    pool = EnginePool([a, b])
    held = _Open(pool)
    assert [await held.open(f"r{i}") for i in range(4)] == [0, 1, 0, 1]
    await held.close("r0")
    await held.close("r2")  # engine 0 now has none, engine 1 two
    # engine 0 until it catches up, then the tie goes to the engine after the last picked
    assert [await held.open(f"s{i}") for i in range(4)] == [0, 0, 1, 0]
    assert [s.in_flight for s in pool.statuses()] == [3, 3]
    await held.close_all()
    assert [s.in_flight for s in pool.statuses()] == [0, 0]
    assert sorted(a.aborted + b.aborted) == sorted(["r0", "r1", "r2", "r3", "s0", "s1", "s2", "s3"])


async def test_a_dead_engine_gets_no_new_work_until_it_is_healthy_again():
    a, b = _engines()
    pool = EnginePool([a, b])
    held = _Open(pool)
    a.dead = True
    assert pool.healthy
    assert [await held.open(f"r{i}") for i in range(3)] == [1, 1, 1]
    a.dead = False
    assert [await held.open(f"s{i}") for i in range(3)] == [0, 0, 0]  # least loaded again
    a.dead = b.dead = True
    assert not pool.healthy
    with pytest.raises(EngineUnavailable, match="all 2"):
        await held.open("t")
    a.dead = b.dead = False
    await held.close_all()


async def test_death_mid_stream_fails_only_that_engines_requests():
    a, b = FakeEngine(steps=50, step_delay=0.01), FakeEngine(steps=50, step_delay=0.01)
    pool = EnginePool([a, b])
    a.die_at_step = 5

    async def run(rid: str) -> str:
        try:
            async with aclosing(pool.generate(_req(rid))) as outs:
                async for out in outs:
                    if out.finished:
                        return "done"
        except EngineUnavailable:
            return "unavailable"
        return "cut"

    got = await asyncio.gather(*(run(f"r{i}") for i in range(4)))
    # r0, r2 went to engine 0 (dies), r1, r3 to engine 1
    assert got == ["unavailable", "done", "unavailable", "done"]
    assert [s.in_flight for s in pool.statuses()] == [0, 0]


async def test_abort_goes_to_the_engine_holding_the_request():
    a, b = _engines()
    pool = EnginePool([a, b])
    held = _Open(pool)
    await held.open("x")
    await held.open("y")
    await pool.abort("y")
    await pool.abort("unknown")  # nothing holds it: nothing to free
    assert (a.abort_calls, b.abort_calls) == ([], ["y"])
    await held.close_all()


async def test_a_request_id_in_use_on_any_engine_is_refused():
    a, b = _engines()
    pool = EnginePool([a, b])
    held = _Open(pool)
    await held.open("same")
    with pytest.raises(InvalidRequest) as e:
        await held.open("same")  # engine 1 is less loaded and would have taken it
    assert e.value.field == "request_id"
    await held.close_all()


async def test_a_session_keeps_its_engine_and_moves_when_it_dies():
    a, b = _engines()
    pool = EnginePool([a, b])
    held = _Open(pool)
    await held.open("other")  # engine 0 busy: the session starts on engine 1

    async def session() -> list[int]:
        picks = [await held.open("u0")]
        # the session's later utterances come from tasks it starts (as the speaker's do)
        picks.append(await asyncio.create_task(held.open("u1")))
        picks.append(await held.open("u2"))
        b.dead = True
        picks.append(await held.open("u3"))  # its engine died: routed afresh...
        b.dead = False
        picks.append(await held.open("u4"))  # ...and stays there
        return picks

    with session_affinity():
        picks = await asyncio.create_task(session())
    assert picks == [1, 1, 1, 0, 0]
    assert await held.open("after") == 1  # outside the session: by load again
    await held.close_all()


async def test_stats_are_summed_over_the_engines_that_answer():
    a, b = _engines()
    pool = EnginePool([a, b])
    held = _Open(pool)
    for rid in ("r0", "r1", "r2"):
        await held.open(rid)
    s = await pool.stats()
    assert (s.num_running, s.num_total_blocks, s.active_request_ids) == (3, 256, ["r0", "r1", "r2"])
    b.dead = True
    per_engine = await pool.engine_stats()
    assert [(st.engine, st.healthy, st.in_flight) for st, _ in per_engine] == [(0, True, 2), (1, False, 1)]
    assert per_engine[1][1] is None and per_engine[0][1].num_running == 2
    assert (await pool.stats()).num_total_blocks == 128
    a.dead = True
    with pytest.raises(EngineUnavailable):
        await pool.stats()
    a.dead = b.dead = False
    await held.close_all()


async def test_a_stuck_engine_does_not_blank_the_others_stats():
    a, b = _engines()

    async def stuck():
        await asyncio.sleep(10)

    b.stats = stuck
    pool = EnginePool([a, b])
    per_engine = await pool.engine_stats(timeout_s=0.05)
    assert per_engine[0][1] is not None and per_engine[1][1] is None


def test_one_engine_keeps_the_device_as_given():
    assert placements("auto", 1, [], cuda_count=0) == [Placement("auto", "auto")]
    assert placements("cuda:3", 1, [], cuda_count=4) == [Placement("cuda:3", "cuda:3")]


def test_data_parallel_gpus_each_see_only_their_own():
    got = placements("auto", 2, [], cuda_count=2)
    assert got == [Placement("cuda", "cuda:0", {"CUDA_VISIBLE_DEVICES": "0"}),
                   Placement("cuda", "cuda:1", {"CUDA_VISIBLE_DEVICES": "1"})]
    # cuda:K counts the GPUs the front end sees: through its own CUDA_VISIBLE_DEVICES
    got = placements("cuda", 1, ["cuda:1", "cuda:0"], cuda_count=2, visible="4,6")
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in got] == ["6", "4"]
    assert [p.label for p in got] == ["cuda:1", "cuda:0"]


def test_data_parallel_on_the_cpu():
    assert placements("cpu", 2, [], cuda_count=0) == [Placement("cpu", "cpu")] * 2
    assert placements("auto", 3, [], cuda_count=0) == [Placement("cpu", "cpu")] * 3
    assert placements("cuda", 1, ["cpu", "cpu"], cuda_count=0) == [Placement("cpu", "cpu")] * 2


@pytest.mark.parametrize("device, n, devices, count, needle", [
    ("cuda", 2, [], 1, "data_parallel_size: 2 engines need as many GPUs, 1 visible"),
    ("cuda:1", 2, [], 2, "list one per engine with --devices"),
    ("auto", 1, ["cuda:2"], 2, "devices: cuda:2 does not exist"),
    ("auto", 1, ["cuda", "cuda"], 2, "ambiguous"),
])
def test_impossible_layouts_name_the_option(device, n, devices, count, needle):
    with pytest.raises(ConfigError, match=needle):
        placements(device, n, devices, cuda_count=count)


def test_settings_check_the_pool_options():
    from server.settings import ServerSettings

    assert ServerSettings(devices="cuda:0, cuda:1").device_list == ["cuda:0", "cuda:1"]
    for kw, field in (({"engine": "tgi"}, "engine"), ({"data_parallel_size": 0}, "data_parallel_size"),
                      ({"devices": "cuda:0,,cuda:1"}, "devices"),
                      ({"devices": "cuda:0,cuda:1", "data_parallel_size": 3}, "data_parallel_size")):
        with pytest.raises(ValueError, match=f"ServerSettings.{field}"):
            ServerSettings(**kw)


def test_serve_options_give_each_engine_its_device_and_the_backend_module():
    import argparse

    from server.cli import _serve_parser
    from server.main import engine_args_from, engine_layout
    from server.settings import ENGINE_MODULES, ServerSettings
    from streaming.knobs import from_arguments
    from streaming.profile import ModelProfile

    def layout(*argv: str):
        ap = argparse.ArgumentParser()
        _serve_parser(ap.add_subparsers(dest="cmd"))
        ns = ap.parse_args(["serve", *argv])
        settings = from_arguments(ServerSettings, ns)
        return settings, engine_layout(settings, engine_args_from(ns, "/m", ModelProfile(), "INFO"))

    settings, engines = layout("--device", "cpu", "--data-parallel-size", "2", "--max-num-seqs", "7")
    assert [(args.runner.device, args.scheduler.max_num_seqs, p.env) for args, p in engines] == [("cpu", 7, {})] * 2
    assert ENGINE_MODULES[settings.engine] == "runner.engine.process"
    settings, engines = layout("--engine", "vllm")
    assert ENGINE_MODULES[settings.engine] == "runner.vllm_engine.process" and len(engines) == 1
    _, engines = layout("--devices", "cpu,cpu")
    assert [p.label for _, p in engines] == ["cpu", "cpu"]


async def test_one_engine_failing_to_start_stops_them_all_at_once():
    events: list[str] = []

    class Starting(FakeEngine):
        def __init__(self, name: str, fails: bool):
            super().__init__()
            self.name, self.fails = name, fails

        async def start(self) -> None:
            if self.fails:
                raise EngineUnavailable(f"{self.name}: model failed to load")
            await asyncio.sleep(60)  # still loading

        async def close(self) -> None:
            events.append(f"close {self.name}")

    pool = EnginePool([Starting("a", False), Starting("b", True)])
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(EngineUnavailable, match="b: model failed to load"):
        await pool.start()
    assert asyncio.get_running_loop().time() - t0 < 5
    assert sorted(events) == ["close a", "close b"]
