"""Decode GEMMs alone on the GPU: us per launch of one shape at one M, cuBLAS against Triton tiles
given on the command line (split-K and ragged column groups included), each in a CUDA graph of
28 launches over 8 weight copies (so weights come from HBM, as in a step).

    python -m deploy.bench.gemm_alone --shape 5120x3072 --m 64 \\
        --tiles "64/128/128/4/4/0/0/3;64/128/128/4/4/0/44/3"
    python -m deploy.bench.gemm_alone --shape 3072x3072 --m 64 --residual --tiles "64/32/128/4/6/0/0/1"

A tile is bm/bn/bk/warps/stages/late/groups[/tma]/splits (deploy/bench/common.py parse_tile, then the
split count last): 8 fields are a pointer tile and its splits, so a TMA tile takes all 9. A split
tile's time is the partials' GEMM alone: whoever consumes them adds its sum.
--residual also times each unsplit tile as residual_linear (the residual epilogue of the norm fold).
--head-argmax times greedy ids instead (the lm_head: N is the vocabulary): cuBLAS on the
zero-padded weight + runner/kernels/argmax.py (the engine's path where the table has no head tile),
then per tile that tile's GEMM + the argmax, and runner/kernels/head_argmax.py (one split only).

    python -m deploy.bench.gemm_alone --shape 156940x3072 --m 64 --head-argmax --tiles "64/128/128/8/4/0/0/1/1"
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from deploy.bench.common import parse_tile
from deploy.bench.gemm import _inputs, _time_graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, help="NxK of the weight (nn.Linear layout)")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--gated", action="store_true", help="the gated gate_up epilogue (Triton tiles only)")
    ap.add_argument("--tiles", default="", help="';'-separated bm/bn/bk/warps/stages/late/groups[/tma]/splits")
    ap.add_argument("--residual", action="store_true",
                    help="also each unsplit tile as residual_linear (o_proj with the add + RMSNorm's first half)")
    ap.add_argument("--head-argmax", action="store_true", help="greedy ids of an lm_head (module docstring)")
    args = ap.parse_args()

    from runner.kernels.linear import residual_linear, skinny_linear

    specs = []  # (spec, tile, splits), checked before anything runs
    for spec in filter(None, args.tiles.split(";")):
        fields = [int(f) for f in spec.split("/")]
        tile, splits = (parse_tile(fields[:-1]), fields[-1]) if len(fields) > 7 else (parse_tile(fields), 1)
        if splits < 1:  # 8 fields are a 7-field tile + splits: a TMA tile needs all 9 (.../tma/splits)
            ap.error(f"{spec}: the last field is the split count (>= 1); a TMA tile is bm/bn/bk/w/s/late/groups/1/splits")
        specs.append((spec, tile, splits))
    n, k = map(int, args.shape.split("x"))
    copies, launches = 8, 28
    if args.head_argmax:
        head_argmax_alone(n, k, args.m, specs, copies, launches)
        return
    ws, x = _inputs(n, k, args.m, copies)
    gbytes = n * k * 2 / 1e9
    res, g = torch.randn(args.m, n, device=x.device, dtype=x.dtype), torch.ones(n, device=x.device, dtype=x.dtype)
    us = _time_graph(lambda i: F.linear(x, ws[i]), copies, launches)
    print(f"{args.shape} M={args.m} cuBLAS: {us:.2f} us ({gbytes / us * 1e3:.2f} TB/s)")
    for spec, tile, splits in specs:
        try:
            us = _time_graph(lambda i, t=tile, s=splits: skinny_linear(x, ws[i], None, t, gated=args.gated, split_k=s),
                             copies, launches)
        except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result
            print(f"{args.shape} M={args.m} {spec}: {type(e).__name__} {str(e)[:100]}")
            continue
        print(f"{args.shape} M={args.m} {spec}: {us:.2f} us ({gbytes / us * 1e3:.2f} TB/s)")
        if args.residual and splits == 1 and not args.gated:
            us = _time_graph(lambda i, t=tile: residual_linear(x, ws[i], res, g, 1e-5, t), copies, launches)
            print(f"{args.shape} M={args.m} {spec} residual_linear: {us:.2f} us ({gbytes / us * 1e3:.2f} TB/s)")


def head_argmax_alone(n: int, k: int, m: int, specs, copies: int, launches: int) -> None:
    from runner.kernels.argmax import row_argmax
    from runner.kernels.head_argmax import head_argmax
    from runner.kernels.linear import skinny_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    n_pad = -(-n // 64) * 64  # the engine's padded head (LlamaForCausalLM.pad_lm_head)
    padded = [torch.zeros(n_pad, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    for p in padded:
        p[:n].normal_(0.0, 0.02, generator=g)
    ws = [p[:n] for p in padded]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    gbytes = n * k * 2 / 1e9
    us = _time_graph(lambda i: row_argmax(F.linear(x, padded[i])[:, :n]), copies, launches)
    print(f"{n}x{k} M={m} cuBLAS (padded) + argmax: {us:.2f} us ({gbytes / us * 1e3:.2f} TB/s)")
    for spec, tile, splits in specs:
        assert splits == 1, f"{spec}: the head is not split"
        for name, fn in (("GEMM + argmax", lambda i, t=tile: row_argmax(skinny_linear(x, ws[i], None, t))),
                         ("head_argmax", lambda i, t=tile: head_argmax(x, ws[i], t))):
            try:
                us = _time_graph(fn, copies, launches)
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result
                print(f"{n}x{k} M={m} {spec} {name}: {type(e).__name__} {str(e)[:100]}")
                continue
            print(f"{n}x{k} M={m} {spec} {name}: {us:.2f} us ({gbytes / us * 1e3:.2f} TB/s)")


if __name__ == "__main__":
    main()
