"""The fused SNAC decoder's tiles and precisions against the torch path, for tuning the
`snac` section of a device's table (runner/kernels/tuning). Needs CUDA."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from runner.codecs.config import CodecConfig
from runner.codecs.decoder import SnacWindowDecoder, float_to_s16
from runner.codecs.snac import load_snac
from runner.kernels.snac import Tiles
from runner.models.builders import write_random_snac


def main() -> None:
    """python -m deploy.bench.snac_kernels [--tiles bm,bn,bk,warps,stages ...]: per-call time of the
    torch and fused decoders on a random snac_24khz-shaped model, int16 LSB distance from the
    fp32 torch path, and the fused path's top kernels (needs CUDA)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", nargs="*", default=["128,128,32,8,3", "128,64,32,4,3", "64,64,32,4,2", "64,128,32,4,3"])
    ap.add_argument("--shapes", nargs="*", default=["64x12", "256x12", "256x4"], help="BATCHxFRAMES")
    ap.add_argument("--precisions", nargs="*", default=["bf16x3", "tf32"], help="also timed, with the first tiles")
    args = ap.parse_args()
    dev = torch.device("cuda")
    folder = write_random_snac(Path(tempfile.mkdtemp()) / "snac24")
    model = load_snac(CodecConfig(path=str(folder)), dev)

    def timed(fn, reps: int = 5) -> float:
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / reps

    ref = SnacWindowDecoder(model, 2048, kernels="torch")
    fused = {}
    runs = [("tf32x3", t) for t in args.tiles] + [(p, args.tiles[0]) for p in args.precisions]
    for prec, t in runs:  # each tile shape compiles its own ~10 kernels (~1 s each)
        tiles = Tiles.parse(t)
        try:
            fused[(prec, t)] = SnacWindowDecoder(model, 2048, kernels="triton", matmul_precision=prec, tiles=tiles)
        except Exception as e:  # e.g. bf16x3 on an older Triton: report and go on
            print(f"fused {prec} tiles {t}: {type(e).__name__}: {e}", flush=True)
    for shape in args.shapes:
        B, W = map(int, shape.split("x"))
        codes = torch.randint(0, 4096, (B, W, 7), device=dev)
        starts = torch.arange(B, device=dev) * 3
        seeds = torch.arange(B, device=dev)
        torch.backends.cudnn.allow_tf32 = False
        want = float_to_s16(ref.decode(codes, starts, seeds)).int()
        torch.backends.cudnn.allow_tf32 = True
        def share(ms: float) -> str:
            # Default policy: steady 12-frame windows emit 8 frames; a stream needs 24000 / 2048
            # frames per second, so 256 streams need 256 * 11.72 / 8 windows per second.
            return f"  {256 * 24000 / 2048 / 8 * ms / 1e3 / B * 100:5.1f}% GPU at 256 streams" if W == 12 else ""

        ms = timed(lambda: ref.decode(codes, starts, seeds))
        print(f"B={B} W={W} torch path: {ms:8.2f} ms  {ms * 1e3 / (B * W):6.2f} us/frame{share(ms)}", flush=True)
        for (prec, t), dec in fused.items():
            lsb = (float_to_s16(dec.decode(codes, starts, seeds)).int() - want).abs().max().item()
            ms = timed(lambda: dec.decode(codes, starts, seeds))
            us = ms * 1e3 / (B * W)
            print(f"B={B} W={W} fused {prec:6s} tiles {t:15s}: {ms:8.2f} ms  {us:6.2f} us/frame  max {lsb} LSB{share(ms)}",
                  flush=True)  # fmt: skip
    prec, t = next(iter(fused))
    dec = fused[(prec, t)]
    B, W = max((tuple(map(int, sh.split("x"))) for sh in args.shapes), key=lambda bw: bw[0] * bw[1])
    codes = torch.randint(0, 4096, (B, W, 7), device=dev)
    z = torch.zeros(B, dtype=torch.int64, device=dev)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dec.decode(codes, z, z)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
