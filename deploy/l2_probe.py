"""Does a weight sent to L2 ahead of its GEMM come back as L2 hits, and survive a K/V-sized
stream in between? One decode GEMM (o_proj by default: 3072x3072 bf16, 18.9 MB, the engine's
split tile at M = 64), timed with CUDA events after each preparation:

    cold      L2 flushed (a 256 MB write), then the GEMM
    warm      flushed, the weight read once (a stream over it), then the GEMM: the best case
    pf<P>     flushed, the weight bulk-prefetched (runner/triton_l2.py policy P: 1 normal, 2
              evict_last) by 512 programs, a 20 us sleep, then the GEMM
    pf<P>+s<E> ... with a stream of --stream-mb (the layer's K/V at batch 64, 350 tokens: 92 MB)
              between, read with eviction policy E ("n" default, "f" evict_first)

and the time of the prefetch + stream pair against the stream alone (what the prefetch costs
the launch that hosts it when DRAM is already busy). --carve-out MB sets the persisting-L2
limit first (cudaLimitPersistingL2CacheSize; evict_last lines may need it).

    python3 deploy/l2_probe.py [--shape 3072x3072 --m 64 --stream-mb 92 --carve-out 0]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.triton_l2 import l2_prefetch_share, prefetch_chunk  # noqa: E402
from runner.triton_linear import skinny_linear, split_tile_for  # noqa: E402


@triton.jit
def _prefetch_kernel(w_ptr, total, chunk, POLICY: tl.constexpr):
    l2_prefetch_share(w_ptr, total, chunk, tl.program_id(0), POLICY)


@triton.jit
def _stream_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr, EVICT: tl.constexpr):
    """Reads ITERS * BLOCK int32 per program once (a K/V-like stream), stores one sum."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0, eviction_policy=EVICT)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def stream(buf: torch.Tensor, sink: torch.Tensor, evict: str) -> None:
    block, iters = 2048, 8
    n = buf.numel()
    _stream_kernel[(triton.cdiv(n, block * iters),)](buf, sink, n, BLOCK=block, ITERS=iters, EVICT=evict, num_warps=8,
                                                     num_stages=1)  # plain loads: cp.async would drop the policy


def set_carve_out(mb: int) -> None:
    lib = ctypes.CDLL("libcudart.so" if _has("libcudart.so") else _cudart())
    rc = lib.cudaDeviceSetLimit(ctypes.c_int(0x06), ctypes.c_size_t(mb << 20))  # cudaLimitPersistingL2CacheSize
    print(f"persisting L2 limit {mb} MB: cudaDeviceSetLimit rc {rc}")


def _has(name: str) -> bool:
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


def _cudart() -> str:
    import glob
    import os

    hits = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu*", "lib", "libcudart.so*"))
    hits += glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
    assert hits, "libcudart not found"
    return hits[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="3072x3072")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--stream-mb", type=int, default=92)
    ap.add_argument("--carve-out", type=int, default=0, help="persisting L2 limit in MB (0: leave it)")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    if args.carve_out:
        set_carve_out(args.carve_out)

    n, k = map(int, args.shape.split("x"))
    dev = "cuda"
    torch.manual_seed(0)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(args.m, k, device=dev, dtype=torch.bfloat16)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    kv = torch.randint(0, 100, ((args.stream_mb << 20) // 4,), device=dev, dtype=torch.int32)
    sink = torch.empty(1 << 16, device=dev, dtype=torch.int32)
    split = split_tile_for(n, k, args.m)
    tile, splits = split if split is not None else (None, 1)
    assert tile is not None, f"no split tile for {args.shape} at M = {args.m}"
    programs = 512
    chunk = prefetch_chunk(w.nbytes, programs)
    w_u8 = w.view(torch.uint8).view(-1)

    def gemm() -> None:
        skinny_linear(x, w, None, tile, split_k=splits)

    def prefetch(policy: int) -> None:
        _prefetch_kernel[(programs,)](w, w.nbytes, chunk, POLICY=policy, num_warps=1)

    def timed(prep, body) -> float:
        """us of body after prep (events around body only), median over reps."""
        times = []
        for _ in range(args.reps):
            flush.zero_()
            prep()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            body()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        return statistics.median(times)

    sleep_cycles = 40_000  # ~20 us at ~2 GHz
    for _ in range(3):  # compile everything once
        gemm(), prefetch(1), prefetch(2), stream(kv, sink, ""), stream(kv, sink, "evict_first"), stream(w_u8.view(torch.int32), sink, "")
    torch.cuda.synchronize()

    rows = {}
    rows["cold"] = timed(lambda: None, gemm)
    rows["warm"] = timed(lambda: stream(w_u8.view(torch.int32), sink, ""), gemm)
    for p in (1, 2):
        rows[f"pf{p}"] = timed(lambda p=p: (prefetch(p), torch.cuda._sleep(sleep_cycles)), gemm)
        for ev, tag in (("", "n"), ("evict_first", "f")):
            rows[f"pf{p}+s{tag}"] = timed(lambda p=p, ev=ev: (prefetch(p), stream(kv, sink, ev)), gemm)
    rows["warm+sn"] = timed(lambda: (stream(w_u8.view(torch.int32), sink, ""), stream(kv, sink, "")), gemm)
    rows["warm+sf"] = timed(lambda: (stream(w_u8.view(torch.int32), sink, ""), stream(kv, sink, "evict_first")), gemm)
    # what hosting the prefetch costs a busy stream
    rows["stream alone"] = timed(lambda: None, lambda: stream(kv, sink, "evict_first"))
    for p in (1, 2):
        rows[f"pf{p} + stream"] = timed(lambda: None, lambda p=p: (prefetch(p), stream(kv, sink, "evict_first")))
        rows[f"pf{p} + stream + gemm"] = timed(lambda: None,
                                              lambda p=p: (prefetch(p), stream(kv, sink, "evict_first"), gemm()))
    rows["stream + gemm"] = timed(lambda: None, lambda: (stream(kv, sink, "evict_first"), gemm()))

    print(f"{torch.cuda.get_device_name()} {args.shape} M={args.m} tile {tile} x{splits}; stream {args.stream_mb} MB; "
          f"carve-out {args.carve_out} MB; median of {args.reps}")
    print("| case | us |\n| --- | ---: |")
    for name, us in rows.items():
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
