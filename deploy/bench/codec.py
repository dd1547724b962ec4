"""The SNAC 24 kHz codec stage (random weights). Sections (pick with --sections):

  codec        batched window decode cost in fp32 and bf16, and the codec's share of GPU time
               at 256 real-time streams under the default window policy
  codec_tiles  the fused SNAC decoder per tile shape (--codec-tiles), ms per call at the serving
               shapes, int16 distance from the first (reference) tiles, and the reference's
               kernel timeline in layer order

    python -m deploy.bench.codec --sections codec
"""

from __future__ import annotations

import argparse
import sys

import torch

from deploy.bench.common import (
    add_out_arg,
    log,
    random_snac_folder,
    run_header,
    write_results,
)


def time_decode(dec, frames: int, B: int, repeats: int = 10) -> float:
    codes = torch.randint(0, 4096, (B, frames, 7), device="cuda")
    starts = torch.zeros(B, dtype=torch.int64, device="cuda")
    seeds = torch.arange(B, dtype=torch.int64, device="cuda")
    return time_decode_inputs(dec, codes, starts, seeds, repeats)


def run_codec():
    from runner.codecs.config import CodecConfig
    from runner.codecs.stage import CodecStage

    folder = random_snac_folder()  # snac_24khz, random weights
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        cfg = CodecConfig(path=str(folder))
        stage = CodecStage(cfg, torch.device("cuda"), dtype)
        pol = cfg.policy
        tag = str(dtype).removeprefix("torch.")
        for frames in sorted({4, pol.max_window_frames}):
            for B in (1, 64, 256):
                t = time_decode(stage.decoder, frames, B)
                res[f"{tag}_window{frames}_B{B}_ms"] = t * 1e3
                log(f"  codec {tag} window={frames} frames B={B}: {t*1e3:.2f} ms")
        # each real-time stream needs 24000/2048 = 11.72 frames/s; a steady window emits
        # `steady_chunk` frames, so 256 streams need 256*11.72/steady windows per second,
        # decoded 256 at a time
        calls_per_s = (24000 / 2048) / pol.steady_chunk
        res[f"{tag}_gpu_share_256_streams"] = calls_per_s * res[f"{tag}_window{pol.max_window_frames}_B256_ms"] / 1e3
        res["policy"] = {"left": pol.left_context, "right": pol.right_context, "chunks": list(pol.chunk_frames)}
        log(f"  codec {tag}: share of GPU time at 256 real-time streams: {res[f'{tag}_gpu_share_256_streams']*100:.1f}%")
        del stage
        torch.cuda.empty_cache()
    return res


def run_codec_tiles(tiles_list: list[str]) -> dict:
    """Fused SNAC decoder per tile shape, bf16 model: ms per call at the serving shapes and the
    int16 distance from the current default tiles (a tile shape only changes float rounding)."""
    from runner.codecs.config import CodecConfig
    from runner.codecs.decoder import SnacWindowDecoder, float_to_s16
    from runner.codecs.snac import load_snac
    from runner.kernels.snac import Tiles

    folder = random_snac_folder()  # snac_24khz, random weights
    model = load_snac(CodecConfig(path=str(folder)), torch.device("cuda"), torch.bfloat16)
    shapes = [(256, 12), (64, 12), (256, 5), (1, 3)]
    inputs = {bw: (torch.randint(0, 4096, (bw[0], bw[1], 7), device="cuda"),
                   torch.arange(bw[0], device="cuda") * 3, torch.arange(bw[0], device="cuda")) for bw in shapes}
    res, ref = {}, None
    for t in tiles_list:
        try:
            dec = SnacWindowDecoder(model, 2048, kernels="triton", tiles=Tiles.parse(t))
        except Exception as e:  # OutOfResources etc.: report, go on with the next shape
            res[t] = {"error": f"{type(e).__name__}: {e}"[:300]}
            log(f"  codec tiles {t}: {res[t]['error']}")
            continue
        row = {}
        for (B, W), (codes, starts, seeds) in inputs.items():
            row[f"B{B}xW{W}_ms"] = time_decode_inputs(dec, codes, starts, seeds) * 1e3
        codes, starts, seeds = inputs[(64, 12)]
        pcm = float_to_s16(dec.decode(codes, starts, seeds)).int()
        ref = pcm if ref is None else ref
        row["max_lsb_vs_first"] = (pcm - ref).abs().max().item()
        if ref is pcm:  # the first (default) tiles: which layers the time goes to
            row["kernel_timeline_us"] = codec_kernel_timeline(dec, *inputs[(256, 12)])
        res[t] = row
        log(f"  codec tiles {t}: {row}")
        del dec
    return res


def codec_kernel_timeline(dec, codes, starts, seeds) -> list[tuple[str, float]]:
    """Kernels of one window decode in launch order (= decoder layer order) and their µs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dec.decode(codes, starts, seeds)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.decode(codes, starts, seeds)
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    return [(e.name[:40], round(e.time_range.elapsed_us(), 1)) for e in ev]


def time_decode_inputs(dec, codes, starts, seeds, repeats: int = 10) -> float:
    for _ in range(2):
        dec.decode(codes, starts, seeds)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(repeats):
        dec.decode(codes, starts, seeds)
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / repeats / 1e3


def render(res: dict) -> str:
    lines = [f"date {res['date']}, GPU {res['gpu']}, torch {res['torch']}, command `{res['command']}`"]
    if "codec" in res:
        c = res["codec"]
        lines += ["", "codec window decode (ms): " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in c.items() if k.endswith("_ms")),
                  "codec share of GPU time at 256 real-time streams: " + ", ".join(
                      f"{k.split('_')[0]} {v*100:.1f}%" for k, v in c.items() if k.endswith("share_256_streams")) + f" (policy {c['policy']})"]
    if "codec_tiles" in res:
        lines += ["", "fused SNAC decoder (bf16) per tile shape (bm,bn,bk,warps,stages), ms per call:", ""]
        shapes = next(([k for k in r if k != "kernel_timeline_us"] for r in res["codec_tiles"].values() if "error" not in r), [])
        lines += ["| tiles | " + " | ".join(shapes) + " |", "| --- |" + " --- |" * len(shapes)]
        for t, r in res["codec_tiles"].items():
            cells = [r["error"]] if "error" in r else [f"{r[k]:.2f}" if k.endswith("_ms") else str(r[k]) for k in shapes]
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        for t, r in res["codec_tiles"].items():
            if "kernel_timeline_us" in r:
                lines += ["", f"kernels of one 256 x 12-frame decode, tiles {t}, in layer order (us): "
                          + ", ".join(f"{n} {us:.0f}" for n, us in r["kernel_timeline_us"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="codec", help="comma-separated: codec, codec_tiles")
    ap.add_argument("--codec-tiles", nargs="*", default=["64,128,32,4,3", "64,128,32,4,3,1", "128,128,32,8,3,1",
                                                          "64,64,32,4,2,1", "64,256,32,8,3,1"],
                    help="bm,bn,bk,warps,stages[,fast_sin]; the first is the reference (and gets a kernel timeline)")
    add_out_arg(ap, "codec")
    args = ap.parse_args()
    secs = set(args.sections.split(","))
    res = run_header()
    if "codec" in secs:
        res["codec"] = run_codec()
    if "codec_tiles" in secs:
        res["codec_tiles"] = run_codec_tiles(args.codec_tiles)
    write_results(args.out, res, render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
