"""Mimi (CSM's codec) decode throughput on the GPU, random weights of the real architecture
(MimiConfig() defaults: 32 codebooks of 2048, 24 kHz, 12.5 frames/s), through the codec stage's
own decoder and its CUDA graphs (runner/codecs/mimi_graphs.py), on the decoder's stream.

Per (rows, chunk frames) graph bucket: GPU ms per replay (CUDA events around `reps` replays)
and the audio it decodes per GPU second; `streams` = how many real-time streams the codec alone
would carry if every call were of this shape (rows x frames x 80 ms of audio per call, over the
call's time). The serving mix is doubling chunks (1, 2, 4, 8, then 16 frames per call): the
long chunks set the steady-state cost, the short ones the cost of starting streams. Per dtype
(--dtypes), since the codec's dtype is a server setting (`--codec-dtype`).

`--profile ROWSxFRAMES` adds the kernels of one eager decode of that shape (torch.profiler).

    python -m deploy.bench.mimi --rows 1,16,64,256 --frames 1,2,4,8,16 --dtypes bfloat16,float32
"""

from __future__ import annotations

import argparse
import sys

import torch

from deploy.bench.common import add_out_arg, log, run_header, scratch, write_results
from deploy.bench.csm import FRAME_S
from deploy.bench.frame_models import mimi_folder


def build_stage(dtype: torch.dtype, max_rows: int, max_frames: int, max_streams: int):
    from runner.codecs.mimi_stage import MimiCodecConfig, MimiCodecStage

    cfg = MimiCodecConfig(path=str(mimi_folder(scratch("mimi-random"))), max_batch_rows=max_rows,
                          max_chunk_frames=max_frames, max_streams=max_streams)
    return MimiCodecStage(cfg, torch.device("cuda"), dtype)


def time_bucket(dec, rows: int, frames: int, reps: int) -> float:
    """GPU ms per graph replay of (rows, frames) on the decoder's stream (streams 0..rows-1)."""
    codes = torch.randint(0, dec.codebook_size, (rows, dec.num_codebooks, frames), device="cuda")
    slots = list(range(rows))
    with torch.cuda.stream(dec.stream):
        for _ in range(3):
            dec.graphs.run(rows, slots, codes)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            dec.graphs.run(rows, slots, codes)
        b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def profile_eager(dec, rows: int, frames: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    codes = torch.randint(0, dec.codebook_size, (rows, dec.num_codebooks, frames), device="cuda")
    idx = torch.arange(rows, device="cuda")
    with torch.inference_mode(), torch.cuda.stream(dec.stream):
        dec._decode_into(idx, codes)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec._decode_into(idx, codes)
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--frames", default="1,2,4,8,16")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", default="", help="ROWSxFRAMES: the kernels of one eager decode of that shape")
    add_out_arg(ap, "mimi")
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    frames = [int(x) for x in args.frames.split(",")]
    res = run_header() | {"buckets": []}
    md = [f"# Mimi decode throughput, {res['gpu']}, {res['date']}", "", f"`{res['command']}`", "",
          "| dtype | rows | frames | GPU ms / call | ms per stream-frame | real-time streams at this shape |",
          "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        stage = build_stage(dtype, max(rows), max(frames), max(rows))
        dec = stage.decoder
        for b in rows:
            for m in frames:
                ms = time_bucket(dec, b, m, args.reps)
                streams = b * m * FRAME_S / (ms / 1e3)
                res["buckets"].append({"dtype": name, "rows": b, "frames": m, "ms": ms, "streams": streams})
                md.append(f"| {name} | {b} | {m} | {ms:.2f} | {ms / (b * m):.3f} | {streams:.0f} |")
                log(f"mimi {name} rows {b} frames {m}: {ms:.2f} ms/call, {streams:.0f} real-time streams")
        if args.profile:
            pb, pm = (int(x) for x in args.profile.split("x"))
            md += ["", f"## eager decode, {name}, {pb} rows x {pm} frames", "", "```", profile_eager(dec, pb, pm), "```"]
        del stage, dec
        torch.cuda.empty_cache()
    write_results(args.out, res, "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
