"""Host time of the engine step's per-request bookkeeping at serving batch sizes (no model).

At 400 streams the H200 engine step is bounded by host work as much as by the GPU
(deploy/RESULTS.md: schedule ~1.2 ms, sample ~2 ms, emit ~1 ms per step). This times the
device-independent parts on the CPU, so a change to them can be measured anywhere:
Scheduler.schedule, SamplingTable.batch (the per-step sampling inputs) and
Scheduler.update_from_output, for N running decode requests.

    python deploy/bench_host.py --rows 64,256,400
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runner.config import SchedulerConfig  # noqa: E402
from runner.kv_cache import BlockManager  # noqa: E402
from runner.request import Request  # noqa: E402
from runner.sampler import SamplingTable  # noqa: E402
from runner.sampling_params import SamplingParams  # noqa: E402
from runner.scheduler import Scheduler  # noqa: E402


def measure(n: int, steps: int = 300) -> dict[str, float]:
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
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,256,400")
    args = ap.parse_args()
    print("| rows | schedule ms | sampling batch ms | update ms |")
    print("| ---: | ---: | ---: | ---: |")
    for n in map(int, args.rows.split(",")):
        r = measure(n)
        print(f"| {n} | {r['schedule']:.3f} | {r['build']:.3f} | {r['update']:.3f} |")


if __name__ == "__main__":
    main()
