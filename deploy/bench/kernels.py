"""Decode kernels alone, Orpheus-3B shapes, in CUDA graphs so that weights and KV stream from HBM
as in a step. Sections (pick with --sections):

  attn        the decode attention kernel: tile / split sweep at batch 1 and 64, context
              135 / 350 / 600, each also with the fused RoPE + KV write
  attn_modes  the decode attention kernel at 350 tokens, batch 1-128, as the engine launches
              it: block table per tile against read in chunks, pipeline depths
  lm_head     the lm_head GEMM at M = 1 and 64: cuBLAS against Triton tiles
  argmax      the greedy row argmax (runner/kernels/argmax.py) over [B, 156940] bf16 logits
  boundary    one dependency between two phases: a kernel boundary (launch chain in a CUDA
              graph, with and without PDL) against a grid barrier in one persistent kernel
              (deploy/bench/boundary_probe.py)

Other kernel probes run on their own: `python -m deploy.bench.ncu_layer` (one decoder layer for
Nsight Compute), `python -m deploy.bench.ws_probe` (warp-specialised TMA GEMMs),
`python -m deploy.bench.gemm_alone` (one GEMM's tiles alone) and `python -m deploy.bench.tune`
(the decode GEMM tile sweeps).

    python -m deploy.bench.kernels --sections attn_modes,lm_head,argmax
"""

from __future__ import annotations

import argparse
import sys

import torch

from deploy.bench.common import (
    ORPHEUS_3B,
    add_out_arg,
    bench_bandwidth,
    log,
    parse_tile,
    run_header,
    write_results,
)
from runner.config import RopeConfig

ATTN_TILES = [(64, 4, 3), (32, 4, 3), (32, 4, 4), (16, 4, 4), (64, 4, 2), (64, 8, 3), (128, 4, 2), (128, 8, 3)]


def _attn_case(B: int, ctx: int, layers: int, table_width: int, seed: int):
    """The attention benchmarks' inputs, Orpheus heads (24/8, D 128, bf16, block 16): one random
    cache per layer ([2, blocks, 16, 8, 128], so KV comes from HBM as in a step), block tables
    scrambled per layer and as wide as the engine's graphs, every sequence at `ctx` tokens, and
    q [B, 24, 128]. Returns (caches, tables, seq_lens, q)."""
    hq, hkv, d, bs = 24, 8, 128, 16
    nblk = -(-ctx // bs)
    g = torch.Generator().manual_seed(seed)
    caches, tables = [], []
    for _ in range(layers):
        caches.append(torch.randn(2, B * nblk + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16))
        t = torch.zeros(B, max(nblk, table_width), dtype=torch.int32)  # graph tables are full width
        t[:, :nblk] = (torch.randperm(B * nblk, generator=g) + 1).view(B, nblk)
        tables.append(t.cuda())
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16)
    return caches, tables, seq_lens, q


def run_attn_modes(batches=(1, 8, 32, 64, 128), ctx: int = 350, layers: int = 28, table_width: int = 128) -> dict:
    """The decode attention kernel alone, Orpheus heads at `ctx` tokens (as run_attn_sweep: one
    cache per layer, scrambled full-width tables, a graph of `layers` launches), launched as the
    engine launches it (PDL; the fused RoPE + KV write where the engine fuses it), us per launch:
    the automatic tiling (choose_tiling), the block table read per tile (3 stages),
    and the table read in chunks ahead of the tile loop with several tiles and stage counts."""
    from deploy.bench.gemm import _time_graph
    from runner.kernels.attention import DecodeRope, paged_decode_attention
    from runner.kernels.gpu_info import num_sms
    from runner.kernels.pdl import pdl_available
    from runner.layers.triton_attention import TritonPagedAttention
    from runner.models.llama import RotaryEmbedding

    hkv, d, bs = 8, 128, 16  # _attn_case's shapes
    pdl = pdl_available("cuda")
    rot = RotaryEmbedding(d, 2048, RopeConfig(theta=ORPHEUS_3B["rope_theta"]))
    cos, sin = rot.cos.cuda(), rot.sin.cuda()
    chunk = {"table_chunk": 128}
    out = {}
    for B in batches:
        split_bn = 32 if B * hkv < num_sms("cuda") else 64
        modes = {"automatic": {}, "table per tile": {"table_chunk": 0, "block_n": split_bn, "num_stages": 3},
                 "chunked": dict(chunk, block_n=split_bn, num_stages=3), "chunked st4": dict(chunk, num_stages=4),
                 "chunked bn32 st4": dict(chunk, block_n=32, num_stages=4),
                 "chunked bn32 st5": dict(chunk, block_n=32, num_stages=5),
                 "chunked bn64 st4": dict(chunk, block_n=64, num_stages=4)}
        nblk = -(-ctx // bs)
        caches, tables, seq_lens, q = _attn_case(B, ctx, layers, table_width, seed=B)
        k, v = (torch.randn(B, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        slots = tables[0][:, nblk - 1].long() * bs + (ctx - 1) % bs
        fused = TritonPagedAttention().decode_rope_fused(B, hkv, q.device)
        rope = DecodeRope(k, v, cos, sin, seq_lens.long() - 1, slots) if fused else None
        kvbytes = B * ctx * hkv * d * 2 * 2
        res = {}
        for name, kw in modes.items():
            def fn(i, kw=kw, caches=caches, tables=tables, q=q, seq_lens=seq_lens, rope=rope):
                paged_decode_attention(q, caches[i], tables[i], seq_lens, d**-0.5, pdl=pdl, rope=rope, **kw)
            try:
                us = _time_graph(fn, layers, launches=layers)
            except Exception as e:  # noqa: BLE001 - a variant that does not fit is a result
                log(f"  attn modes B={B} {name}: {type(e).__name__}")
                continue
            res[name] = {"us": us, "TBps": kvbytes / us / 1e6}
        out[f"B{B}_ctx{ctx}"] = {"kv_bytes": kvbytes, "fused_rope": fused, "modes": res}
        log(f"  attn modes B={B} ctx={ctx}{' +rope' if fused else ''}: "
            + ", ".join(f"{kk} {vv['us']:.1f}" for kk, vv in res.items()))
        del caches
        torch.cuda.empty_cache()
    return out


def run_attn_sweep(batches=(1, 64), ctxs=(135, 350, 600), layers: int = 28, table_width: int = 128,
                   tiles=ATTN_TILES, all_splits: bool = True) -> dict:
    """Decode attention kernel alone (runner/kernels/attention.py), Orpheus heads (24/8, D 128,
    bf16, block 16), every sequence at `ctx` tokens with scrambled block tables, one cache per
    layer (a graph of `layers` launches, so KV comes from HBM as in a step), block tables as wide
    as the engine's graphs (max_model_len 2048 / block 16; the split count follows the width):
    us per launch and TB/s of live KV bytes, per (block_n, warps, stages, splits) variant, each
    also with the fused RoPE + KV write."""
    from deploy.bench.gemm import _time_graph
    from runner.kernels.attention import DecodeRope, paged_decode_attention
    from runner.models.llama import RotaryEmbedding

    hkv, d, bs = 8, 128, 16  # _attn_case's shapes
    rot = RotaryEmbedding(d, 2048, RopeConfig(theta=ORPHEUS_3B["rope_theta"]))
    cos, sin = rot.cos.cuda(), rot.sin.cuda()
    out = {}
    for B in batches:
        for ctx in ctxs:
            caches, tables, seq_lens, q = _attn_case(B, ctx, layers, table_width, seed=ctx)
            kvbytes = B * ctx * hkv * d * 2 * 2
            pos = seq_lens.long() - 1
            slots = tables[0][:, -1].long() * bs + (ctx - 1) % bs
            k = torch.randn(B, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            splits_opts = [None] if not all_splits else [None, 1, 2, 4, 8, 16] if B * hkv < 132 else [None, 2]
            res = {}
            for bn, w, st in tiles:
                for sp in splits_opts:
                    for fused in (False, True):
                        rope = DecodeRope(k, v, cos, sin, pos, slots) if fused else None

                        def fn(i, bn=bn, w=w, st=st, sp=sp, rope=rope):
                            paged_decode_attention(q, caches[i], tables[i], seq_lens, d**-0.5, block_n=bn or None,
                                                   num_warps=w, num_stages=st, num_splits=sp, rope=rope)
                        try:
                            us = _time_graph(fn, layers, launches=layers)
                        except Exception as e:  # noqa: BLE001 - a variant that does not fit is a result
                            log(f"  attn B={B} ctx={ctx} {bn},{w},{st} s{sp}: {type(e).__name__}")
                            continue
                        key = f"bn{bn} w{w} st{st} s{sp or 'auto'}" + (" +rope" if fused else "")
                        res[key] = {"us": us, "TBps": kvbytes / us / 1e6}
            best = min((kk for kk in res if "rope" not in kk), key=lambda kk: res[kk]["us"])
            best_r = min((kk for kk in res if "rope" in kk), key=lambda kk: res[kk]["us"])
            out[f"B{B}_ctx{ctx}"] = {"kv_bytes": kvbytes, "best": best, "best_rope": best_r, "variants": res}
            log(f"  attn B={B} ctx={ctx}: " + ", ".join(f"{kk} {vv['us']:.1f}" for kk, vv in res.items()
                                                      if kk.split(" +")[0] in (best, f"bn{tiles[0][0]} w{tiles[0][1]} st{tiles[0][2]} sauto"))
                + f"; best {best}, best with rope {best_r} {res[best_r]['us']:.1f} us")
            del caches
            torch.cuda.empty_cache()
    return out


LM_HEAD_TILES = {1: ["1,4,1024,4,1", "1,8,1024,4,1", "1,16,1024,4,1", "1,8,512,4,1", "1,16,512,4,1", "1,32,512,8,1",
                     "1,8,2048,4,1", "16,64,128,4,4", "16,128,128,4,4"],
                 64: ["64,64,64,4,5", "64,128,64,4,4", "64,128,128,4,3", "64,64,128,4,4", "64,256,64,8,3"]}


def run_lm_head(tiles=LM_HEAD_TILES, launches: int = 8) -> dict:
    """The Orpheus lm_head GEMM alone ([M, 3072] x [156940, 3072]^T, bf16) at M = 1 and 64: cuBLAS
    on the padded weight (the engine's path, LlamaForCausalLM.pad_lm_head) against Triton tiles of
    runner/kernels/linear.py on the unpadded rows; us per launch and TB/s of weight bytes. The
    weight (0.96 GB) is far above L2, so every launch streams it from HBM."""
    from deploy.bench.gemm import _time_graph
    from runner.kernels.linear import skinny_linear

    v, k = ORPHEUS_3B["vocab_size"], 3072
    vp = -(-v // 64) * 64
    g = torch.Generator(device="cuda").manual_seed(0)
    padded = torch.randn(vp, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w = padded[:v]
    out = {}
    for m, specs in tiles.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = torch.nn.functional.linear(x, padded)[:, :v].float()
        res = {"cublas": _time_graph(lambda i: torch.nn.functional.linear(x, padded), 1, launches)}
        for spec in specs:
            tile = parse_tile([int(f) for f in spec.split(",")])
            try:
                got = skinny_linear(x, w, None, tile).float()
                assert torch.allclose(got, ref, atol=2e-2, rtol=2e-2), (got - ref).abs().max().item()
                res[spec] = _time_graph(lambda i, t=tile: skinny_linear(x, w, None, t), 1, launches)
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result
                log(f"  lm_head M={m} {spec}: {type(e).__name__}: {str(e)[:120]}")
        out[m] = {kk: {"us": us, "TBps": v * k * 2 / us / 1e6} for kk, us in res.items()}
        log(f"  lm_head M={m}: " + ", ".join(f"{kk} {r['us']:.1f} us ({r['TBps']:.2f} TB/s)" for kk, r in out[m].items()))
    return out


def run_argmax(batches=(1, 8, 64, 256)) -> dict:
    """The greedy row argmax alone over [B, 156940] bf16 logits (a column slice of the padded
    head's output, as the engine reads it), us per call in a CUDA graph, against torch.argmax."""
    import triton

    from runner.kernels.argmax import row_argmax

    v = ORPHEUS_3B["vocab_size"]
    out = {}
    for B in batches:
        x = torch.randn(B, -(-v // 64) * 64, device="cuda").to(torch.bfloat16)[:, :v]
        out[B] = {"triton_us": triton.testing.do_bench_cudagraph(lambda x=x: row_argmax(x), rep=200) * 1e3,
                  "torch_us": triton.testing.do_bench_cudagraph(lambda x=x: x.argmax(dim=-1), rep=200) * 1e3}
        log(f"  argmax B={B}: {out[B]['triton_us']:.1f} us (torch.argmax {out[B]['torch_us']:.1f})")
    return out


def render(res: dict) -> str:
    lines = [f"date {res['date']}, GPU {res['gpu']}, torch {res['torch']}, command `{res['command']}`", ""]
    for name in ("attn_modes", "attn"):
        for case, r in res.get(name, {}).items():
            variants = r.get("modes") or r.get("variants")
            lines.append(f"{name} {case}: " + ", ".join(f"{k} {v['us']:.1f} us" for k, v in variants.items()))
    for m, r in res.get("lm_head", {}).items():
        lines.append(f"lm_head M={m}: " + ", ".join(f"{k} {v['us']:.1f} us ({v['TBps']:.2f} TB/s)" for k, v in r.items()))
    for B, r in res.get("argmax", {}).items():
        lines.append(f"argmax B={B}: {r['triton_us']:.1f} us (torch.argmax {r['torch_us']:.1f})")
    if "boundary" in res:
        bd = res["boundary"]
        lines.append(f"One dependency between two phases ({bd['programs']} programs, {bd['phases']} phases), us: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in bd["us_per_dependency"].items()))
    if "bandwidth_Bps" in res:
        lines.append(f"copy bandwidth {res['bandwidth_Bps'] / 1e12:.2f} TB/s")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="bandwidth,attn_modes,lm_head,argmax",
                    help="comma-separated: bandwidth, attn, attn_modes, lm_head, argmax, boundary")
    ap.add_argument("--attn-tiles", default="", help="attn section: 'bn,warps,stages;...' at the automatic split only")
    add_out_arg(ap, "kernels")
    args = ap.parse_args()
    secs = set(args.sections.split(","))
    res = run_header()
    if "bandwidth" in secs:
        res["bandwidth_Bps"] = bench_bandwidth()
    if "attn_modes" in secs:
        res["attn_modes"] = run_attn_modes()
    if "attn" in secs:
        tiles = [tuple(int(x) for x in t.split(",")) for t in args.attn_tiles.split(";")] if args.attn_tiles else ATTN_TILES
        res["attn"] = run_attn_sweep(tiles=tiles, all_splits=not args.attn_tiles)
    if "lm_head" in secs:
        res["lm_head"] = run_lm_head()
    if "argmax" in secs:
        res["argmax"] = run_argmax()
    if "boundary" in secs:
        from deploy.bench.boundary_probe import measure

        res["boundary"] = measure()
        log("  us per dependency: " + ", ".join(f"{k} {v:.2f}" for k, v in res["boundary"]["us_per_dependency"].items()))
    write_results(args.out, res, render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
