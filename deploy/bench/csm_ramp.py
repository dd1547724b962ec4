"""The serving workload of `deploy.bench.csm --sections serving`, in process: a CSM-1B-shaped
engine (random weights, bf16, the server's defaults: graphs, async scheduling, Mimi codec) and
N sessions of two sentences, the bench client's text, voice and seeds (1000 + i), started
--per-step sessions a step; a session's second sentence is added when its first finishes.

Why in process: a stall of the served engine (a GPU kernel that never ends) shows up here
without the server, the front end and the players around it, and a hung step is caught by
`faulthandler` after --hang-s (the stack, then exit 1), so a device call can attach cuda-gdb
or py-spy to a process that is known to be stuck in one step. Each step's shape and host time
go to stdout (the first 60 steps, then every 25th and every step slower than 200 ms).

    python -m deploy.bench.csm_ramp --sessions 1000 --per-step 25 --frames 150
    python -m deploy.bench.csm_ramp --cpu    # a tiny CSM and its codec on the CPU (a dry run)

Found with it: with torch.cuda.graph's shared default capture stream, the frame-step graphs and
the Mimi graphs shared one cuBLAS workspace and the step hung within ~60 steps of 1000 rows
(runner/utils/capture.py `capture_stream`).
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import torch

from deploy.bench.common import scratch
from deploy.bench.frame_models import csm_folder, mimi_folder

TEXTS = ("Hello there.", "This is a short benchmark sentence for streaming speech.")  # server/bench.py's text
BASE_SEED = 1000  # server/bench.py: seed 1000 + i for stream i


def build(cpu: bool, max_num_seqs: int, **knobs):
    from runner.config import EngineConfig
    from runner.engine.engine import Engine
    from runner.families import family_for
    from runner.layers import make_backends
    from server.tokenizer import TextTokenizer
    from server.tts.voices import SpeechProfile
    from streaming.profile import read_profile

    if cpu:
        from tests.support.tiny_models import make_tiny_csm

        folder = make_tiny_csm(scratch("csm-tiny-host"), seed=3, hidden=32, depth_hidden=32, layers=1, depth_layers=1)
        prompts = [[1, 5, 6, 7], [1, 5, 6, 7, 8, 9]]
        profile = read_profile(folder)
    else:
        folder = csm_folder(scratch("csm1b-random"))
        profile = read_profile(folder, str(mimi_folder(scratch("mimi-random"))))
        tok, speech = TextTokenizer.from_folder(folder), SpeechProfile(profile.speech)
        prompts = [speech.build_prompt(tok, speech.default_voice, t).ids for t in TEXTS]  # the server's prompts
    dev = torch.device("cpu" if cpu else "cuda")
    cfg = EngineConfig.build(folder, device=dev.type, dtype="float32" if cpu else "bfloat16",
                             max_num_seqs=max_num_seqs, **knobs)
    family = family_for(profile, str(folder))
    codec = family.build_codec(dev, torch.float32 if cpu else torch.bfloat16, cfg.runner.tuning)
    attn, ops = make_backends(cfg.runner)
    eng = Engine(cfg, model=family.load_model(cfg, attn, ops, random_weights=True), family=family, codec=codec)
    if not cpu:
        eng.warm_up()
    return eng, prompts


def run(eng, prompts: list[list[int]], sessions: int, per_step: int, frames: int, hang_s: float) -> tuple[int, int]:
    """Steps until every session's two sentences are done -> (steps, sentences finished)."""
    from streaming.sampling_params import SamplingParams

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_k=50, max_tokens=frames, ignore_eos=True, seed=BASE_SEED + i)

    audio = eng.codec is not None
    started, steps, finished, t_start = 0, 0, 0, time.perf_counter()
    while started < sessions or eng.has_unfinished:
        for _ in range(min(per_step, sessions - started)):
            eng.add_request(f"s{started}-0", prompts[0], params(started), audio=audio)
            started += 1
        faulthandler.dump_traceback_later(hang_s, exit=True)
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        faulthandler.cancel_dump_traceback_later()
        for o in outs:
            finished += o.finished and o.error is None
            if o.finished and o.request_id.endswith("-0"):
                i = int(o.request_id[1:-2])
                eng.add_request(f"s{i}-1", prompts[1], params(i), audio=audio)
        steps += 1
        if steps <= 60 or dt > 0.2 or steps % 25 == 0:
            busy = eng.gpu_streams_busy()
            print(f"{time.perf_counter() - t_start:7.2f} s, step {eng.step_count}, {1e3 * dt:6.1f} ms: "
                  f"{eng.last_scheduled.describe()}; {len(eng.scheduler.running)} running, "
                  f"{len(eng.scheduler.waiting)} waiting" + (f"; {busy}" if busy else ""), flush=True)
    return steps, finished


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--per-step", type=int, default=25, help="sessions started per step")
    ap.add_argument("--frames", type=int, default=150, help="frames per sentence")
    ap.add_argument("--hang-s", type=float, default=30, help="a step this long: dump the stack and exit 1")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--graphs", type=int, default=1)
    ap.add_argument("--pdl", type=int, default=1)
    ap.add_argument("--prefix-caching", type=int, default=1)
    ap.add_argument("--cpu", action="store_true", help="a tiny CSM and its codec on the CPU (a dry run)")
    args = ap.parse_args()
    eng, prompts = build(args.cpu, args.max_num_seqs, cuda_graphs=bool(args.graphs), pdl=bool(args.pdl),
                         enable_prefix_caching=bool(args.prefix_caching))
    steps, finished = run(eng, prompts, args.sessions, args.per_step, args.frames, args.hang_s)
    print(f"done: {finished} of {2 * args.sessions} sentences in {steps} steps", flush=True)
    return 0 if finished == 2 * args.sessions else 1


if __name__ == "__main__":
    sys.exit(main())
