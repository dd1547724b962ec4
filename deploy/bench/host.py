"""Host time of the engine step's per-request bookkeeping at serving batch sizes (no GPU).

At 400 streams the engine step is bounded by host work as much as by the GPU (the serving
edge follows the host's speed). Two measurements, both on the
CPU, so a change to the bookkeeping can be measured anywhere:

* `probe`: Scheduler.schedule, SamplingTable.batch and Scheduler.update_from_output alone for N
  running decode requests, plus `reference`, a fixed pure-Python workload that does not use the
  project's code: its reading says how fast this host runs Python, so a probe from another
  machine or another version of the code can be put in proportion.
* `engine` (--engine): the real Engine (embedded default model, codec stage, async scheduling)
  with N audio requests in steady decode, the model forward and the SNAC decode replaced by
  stubs, so what remains is the step's host work: schedule, input packing, sampling inputs (the
  CPU sampler's tensor math is left in, reported separately and excluded from `host`),
  emit (update, codec push, outputs) and the codec stage's bookkeeping.

    python -m deploy.bench.host --rows 64,256,400 --engine
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from deploy.bench.common import add_out_arg
from runner.config import SchedulerConfig
from runner.engine.kv_cache import BlockManager
from runner.engine.request import Request
from runner.engine.scheduler import Scheduler
from runner.layers.sampling_batch import SamplingTable
from streaming.sampling_params import SamplingParams


def reference(reps: int = 9) -> float:
    """ms of a fixed pure-Python workload (dicts, lists, attribute reads, small ints: what the
    step's bookkeeping is made of); median of `reps`."""

    class Obj:
        __slots__ = ("a", "b", "c")

        def __init__(self, i: int) -> None:
            self.a, self.b, self.c = i, [i], {}

    def work() -> int:
        objs = [Obj(i) for i in range(2000)]
        d: dict[int, int] = {}
        s = 0
        for o in objs:
            o.b.append(o.a + 1)
            s += o.a * 3 + len(o.b)
            d[o.a] = s & 0xFFFF
            if o.a % 7 == 0:
                o.c["k"] = d.get(o.a - 1, 0)
        return s + sum(d.values())

    times = []
    for _ in range(reps):
        t = time.perf_counter()
        work()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(n: int, steps: int = 300) -> dict[str, float]:
    """Median ms of schedule / sampling-table batch / update for n running decode requests."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=16384, max_model_len=4096),
                      BlockManager(n * 300, 16, True))
    for i in range(n):
        sp = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=100000, seed=i)
        sched.add(Request(f"r{i}", [1 + (i + j) % 100 for j in range(30)], sp, audio=True))
    table = SamplingTable(n, eos_token_ids=(2,))  # the runner's per-slot sampling inputs
    out = sched.schedule()  # the prefill step
    for e in out.scheduled:
        table.set(e.req.slot, e.req.sampling, e.req.sampling.seed)
    sched.update_from_output(out, [5] * n)
    times: dict[str, list[float]] = {"schedule": [], "build": [], "update": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        reqs = [e.req for e in out.scheduled]
        table.batch([r.slot for r in reqs], [len(r.output_token_ids) for r in reqs], [r.sampling for r in reqs], "cpu")
        t2 = time.perf_counter()
        sched.update_from_output(out, [7] * len(out.scheduled))
        t3 = time.perf_counter()
        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[k].append(dt * 1e3)
    res = {k: statistics.median(v) for k, v in times.items()}
    res["reference"] = reference()
    return res


@contextlib.contextmanager
def timed_calls(targets: dict[str, tuple[object, str]]) -> Iterator[tuple[dict[str, float], dict[str, float]]]:
    """Wrap each `obj.attr` of `targets` (name -> (obj, attr); obj None: skipped) while the
    block runs; yields ({name: wall seconds}, {name: CPU seconds of the calling thread}) summed
    over its calls (a few hundred ns of overhead per call), then unwraps them."""
    wall = dict.fromkeys(targets, 0.0)
    cpu = dict.fromkeys(targets, 0.0)
    saved = []
    for name, (obj, attr) in targets.items():
        if obj is None:
            continue
        fn = getattr(obj, attr)
        saved.append((obj, attr, obj.__dict__.get(attr)))

        def timed(*a, _fn=fn, _name=name, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                wall[_name] += time.perf_counter() - t
                cpu[_name] += time.thread_time() - c

        setattr(obj, attr, timed)
    try:
        yield wall, cpu
    finally:
        for obj, attr, old in reversed(saved):
            if old is None:  # the attribute came from the class: drop the instance's wrapper
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


def measure_engine(n: int, steps: int = 60, repeats: int = 5, warm_steps: int = 30) -> dict[str, float]:
    """Host ms per step of the real Engine with n audio requests decoding (see the module
    docstring): per phase, the CPU sampler's math (`sampler_math`, not host bookkeeping on a
    GPU), `host` = the step minus the stubs' and the sampler math's time, and `host_cpu` the
    same in this thread's CPU time (steadier on a shared host). Each figure is the least of
    `repeats` means over `steps` steps."""
    import torch

    from runner.codecs.decoder import PendingPCM
    from runner.engine.args import engine_args
    from runner.engine.process import build_engine
    from runner.models.default_model import ensure_default_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        eng = build_engine(engine_args(str(ensure_default_model(tmp)), device="cpu",
                                          max_num_seqs=n, max_num_batched_tokens=max(2048, 2 * n),
                                          num_blocks=n * 64, cpu_threads=1))
    hidden = eng.cfg.model.hidden_size

    # The forward returns ones, and the lm_head row of the end-of-speech token is negative, so
    # no stream ends while measured (every row samples among the audio codes).
    def forward(input_ids, positions, kv_caches, meta, capture):
        return torch.ones(input_ids.shape[0], hidden), {}

    eng.model.forward = forward
    with torch.no_grad():
        eng.model.lm_head_weight[eng.codec.cfg.end_token_id] = -1.0
    spf = eng.codec.decoder.samples_per_frame

    def launch_jobs(windows, jobs, seeds):  # silence of the right length, at once
        return PendingPCM(torch.zeros(len(jobs), windows[0].shape[0] * spf, dtype=torch.int16),
                          [j.emit_slice(spf) for j in jobs], None)

    eng.codec.decoder.launch_jobs = launch_jobs
    math = {"sampler_math": (eng.runner, "_sample_constrained")}
    for i in range(n):
        sp = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=100000, seed=i)
        eng.add_request(f"r{i}", [1 + (i + j) % 100 for j in range(30)], sp, audio=True)
    for _ in range(warm_steps):
        eng.step()
    assert len(eng.scheduler.running) == n, "every stream must still be decoding"
    gc.collect()
    gc.freeze()  # as the engine process does once ready (runner/engine/process.py)
    # blocks of steps, each phase's least block mean: the host is shared, and a phase only
    # reads slower than its code runs
    blocks: list[dict[str, float]] = []
    for _ in range(repeats):
        eng.phase_s = [0.0] * len(eng.PHASES)
        with timed_calls(math) as (math_wall, math_cpu):
            t, c = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                eng.step()
            wall, cpu = time.perf_counter() - t, time.thread_time() - c
        b = {name: 1e3 * v / steps for name, v in zip(eng.PHASES, eng.phase_s)}
        b["sampler_math"] = 1e3 * math_wall["sampler_math"] / steps
        b["sample"] -= b["sampler_math"]
        b["host"] = 1e3 * wall / steps - b["sampler_math"]
        # the same in CPU time of this thread: a shared host's stolen cycles do not count
        b["host_cpu"] = 1e3 * (cpu - math_cpu["sampler_math"]) / steps
        blocks.append(b)
    res = {k: min(b[k] for b in blocks) for k in blocks[0]}
    gc.unfreeze()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,256,400")
    ap.add_argument("--engine", action="store_true", help="also time the whole engine step (stubbed model and codec)")
    add_out_arg(ap, "host")
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    lines: list[str] = []

    def emit(line: str = "") -> None:
        lines.append(line)
        print(line, flush=True)

    emit("| rows | schedule ms | sampling batch ms | update ms | reference ms |")
    emit("| ---: | ---: | ---: | ---: | ---: |")
    for n in rows:
        r = measure(n)
        emit(f"| {n} | {r['schedule']:.3f} | {r['build']:.3f} | {r['update']:.3f} | {r['reference']:.3f} |")
    if args.engine:
        emit()
        emit("| rows | host ms/step | host CPU ms/step | schedule | execute | sample (launch) | emit | codec | CPU sampler math (excluded) |")
        emit("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for n in rows:
            r = measure_engine(n)
            emit(f"| {n} | {r['host']:.2f} | {r['host_cpu']:.2f} | {r['schedule']:.2f} | {r['execute']:.2f} | {r['sample']:.2f} | "
                 f"{r['emit']:.2f} | {r['codec']:.2f} | {r['sampler_math']:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
