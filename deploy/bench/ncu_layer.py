"""One Orpheus-3B decoder layer's decode kernels at batch B, for Nsight Compute.

Runs the layer's ops in the engine's order (TritonOps with PDL, fused RoPE + KV write in the
attention, split-K partials into the norms) on random weights, once to compile, then once inside
cudaProfilerStart/Stop, so that

    ncu --profile-from-start off --clock-control none --set full -o $OUT/layer \\
        python -m deploy.bench.ncu_layer --batch 64

profiles exactly one launch of each kernel (ncu replays each one in isolation: no PDL overlap,
caches flushed between passes, so weights and KV come from HBM). The cache, block table and
lengths are the attention benchmarks' (deploy/bench/kernels.py `_attn_case`).

Why: the step's kernels run at 2.2-3.5 TB/s against ~4.2 copy bandwidth at batch 64, and the
engine-level timings (skip variants, critical-path profiles) say how much each costs but not
where inside a kernel the time goes (ramp, tail, stalls, occupancy).
"""

from __future__ import annotations

import argparse

import torch

from deploy.bench.kernels import _attn_case
from runner.config import RopeConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=350, help="tokens per sequence already in the cache")
    args = ap.parse_args()

    from runner.kernels.attention import DecodeRope, paged_decode_attention
    from runner.kernels.pdl import pdl_available
    from runner.layers.triton_ops import TritonOps
    from runner.models.llama import RotaryEmbedding

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    B, ctx = args.batch, args.ctx
    H, I, hq, hkv, d, bs = 3072, 8192, 24, 8, 128, 16
    ops = TritonOps(pdl=pdl_available(dev))

    def lin(n: int, k: int) -> torch.nn.Linear:
        m = torch.nn.Linear(k, n, bias=False, device=dev, dtype=dt)
        torch.nn.init.normal_(m.weight, std=0.02)
        return m

    qkv, o_proj, gate_up, down = lin((hq + 2 * hkv) * d, H), lin(H, hq * d), lin(2 * I, H), lin(H, I)
    w1 = torch.ones(H, device=dev, dtype=dt)
    w2 = torch.ones(H, device=dev, dtype=dt)
    # ctx cached tokens plus this step's, whose slot the fused RoPE + KV write fills
    (cache,), (tables,), seq_lens, _ = _attn_case(B, ctx + 1, 1, 128, seed=B)
    pos = seq_lens.long() - 1
    slots = tables[:, ctx // bs].long() * bs + ctx % bs
    rot = RotaryEmbedding(d, 2048, RopeConfig(theta=500000.0))
    cos, sin = rot.cos.to(dev), rot.sin.to(dev)
    residual = torch.randn(B, H, device=dev, dtype=dt)
    down_out = ops.linear(torch.randn(B, I, device=dev, dtype=dt), down, into_norm=True)  # partials, as in a step

    def layer() -> None:
        x, res = ops.add_rmsnorm(down_out, residual, w1, 1e-5)
        t = ops.linear(x, qkv)
        q, k, v = t.split((hq * d, hkv * d, hkv * d), dim=-1)
        q, k, v = q.view(B, hq, d), k.view(B, hkv, d), v.view(B, hkv, d)
        out = paged_decode_attention(q, cache, tables, seq_lens, d**-0.5, pdl=ops.pdl,
                                     rope=DecodeRope(k, v, cos, sin, pos, slots))
        ops.post_attention(out.reshape(B, hq * d), o_proj, res, w2, 1e-5, gate_up, down)

    layer()  # compile
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    layer()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"batch {B} ctx {ctx}: profiled one layer")


if __name__ == "__main__":
    main()
