"""One depth-decoder sub-step, three ways, on random weights of a real shape (bf16, CUDA graphs):
the layer path (runner/models/llama.py layers over the tuned Triton ops: ~27 launches), the
persistent kernel (runner/kernels/depth_step.py: one launch, grid barriers) and the same kernel
one launch per phase (no barriers), with each phase kind's share. µs per sub-step at position
K / 2, next to the bound (its weight bytes over the copy bandwidth measured in the same run).

    python -m deploy.bench.depth_step [--model csm|qwen3_tts] [--rows 1,8,16,32,64]
        [--write-table runner/kernels/tuning/NAME.json]

--write-table puts the model's depth-decoder shape into (or takes it out of) the table's `depth`
section: in when the one-row kernel (the module's tiles) beat the layer path at one row in this
run, out otherwise. `RunnerConfig.depth_step` "auto" reads that section.
"""

from __future__ import annotations

import argparse

import torch

from deploy.bench.common import add_out_arg, bench_bandwidth, log, run_header, write_results

SHAPES = {  # the depth decoders of CSM-1B (CsmConfig()) and Qwen3-TTS 12 Hz 1.7B
    "csm": dict(hidden=1024, inter=8192, layers=4, heads=8, kv_heads=2, codebooks=32, vocab=2051, qk_norm=False),
    "qwen3_tts": dict(hidden=1024, inter=3072, layers=5, heads=16, kv_heads=8, codebooks=16, vocab=2048,
                      qk_norm=True),
}
PHASES = ("qkv", "attention", "o_proj", "gate_up", "down")


def build(shape: dict, max_rows: int):
    from runner.config import ModelConfig, RopeConfig, RunnerConfig
    from runner.layers import make_backends
    from runner.models.csm_parts import CsmDepthDecoder, DepthKV

    cfg = ModelConfig(path="", decoder="qwen3" if shape["qk_norm"] else "llama", vocab_size=shape["vocab"],
                      hidden_size=shape["hidden"], intermediate_size=shape["inter"], num_layers=shape["layers"],
                      num_heads=shape["heads"], num_kv_heads=shape["kv_heads"], head_dim=128, rms_norm_eps=1e-6,
                      max_position_embeddings=shape["codebooks"], tie_word_embeddings=False, attention_bias=False,
                      qk_norm=shape["qk_norm"], rope=RopeConfig())
    attn, ops = make_backends(RunnerConfig(device="cuda", dtype="bfloat16", depth_step="on"))
    dev = torch.device("cuda")
    with torch.device(dev):
        dec = CsmDepthDecoder(cfg, shape["codebooks"], 2048, attn, ops)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in dec.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device=dev) if name.endswith("norm.weight")
                    else 0.02 * torch.randn(p.shape, generator=g, device=dev))
    dec = dec.to(torch.bfloat16)
    dec.rotary.reset(dev)
    dec.prepare_decode()
    if dec.step is None:
        raise SystemExit("the depth step kernel is off (RunnerConfig.depth_step) or does not fit this shape")
    return dec, DepthKV(cfg, shape["codebooks"], max_rows, dev, torch.bfloat16)


def weight_bytes(dec) -> int:
    """Bytes a sub-step reads: every layer's weights and norms, the final norm, one head."""
    w = dec.step.weights
    parts = (w.qkv, w.o, w.gate_up, w.down, w.ln1, w.ln2, w.norm, w.heads[0])
    return sum(t.numel() * t.element_size() for t in parts)


def run(model: str, rows: list[int], row_tiles: list[str]) -> dict:
    """row_tiles: variants of depth_step.ROW_TILES for the one-row kernel ("" = as it is;
    "gate_up_n=64,gate_up_k=128" replaces those entries), each timed at every row count."""
    from deploy.bench.gemm import _time_graph
    from runner.kernels import depth_step as ds
    from runner.kernels.depth_step import PHASES_PER_LAYER, depth_step

    shape = SHAPES[model]
    dec, kv = build(shape, max(rows))
    weights, scratch, programs, _ = dec.step
    cfg, k = dec.cfg, shape["codebooks"]
    p = k // 2
    bw = bench_bandwidth()
    bound_us = weight_bytes(dec) / bw * 1e6
    out = []
    for m in rows:
        frames = torch.randint(0, shape["vocab"], (m, k), device="cuda")
        meta = kv.step_meta(m, p)

        def layer_path(_i):
            x = dec.projected_codes.index_select(0, frames[:, p - 1] + dec.code_offsets[p - 1])
            return dec.codebook_logits(dec(x, kv.positions[p, :m], kv.caches, meta), p)

        def kernel(_i, tiles, sync=True):
            scratch.counters.zero_()
            return depth_step(weights, scratch, kv.stacked, dec.projected_codes, frames[:, p - 1],
                              dec.code_offsets[p - 1], p, dec.rotary.cos, dec.rotary.sin, cfg.rms_norm_eps,
                              cfg.num_heads, cfg.qk_norm, programs, sync=sync, tiles=tiles)

        layers_us = _time_graph(layer_path, copies=1, launches=20)
        want = layer_path(0).float()
        for variant in row_tiles:
            tiles = dict(ds.ROW_TILES, **{kv.split("=")[0]: int(kv.split("=")[1])
                                          for kv in filter(None, variant.split(","))})
            got = kernel(0, tiles).float()
            err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
            row = {"model": model, "rows": m, "tiles": variant or "default", "bound_us": bound_us, "rel_err": err,
                   "layers_us": layers_us, "kernel_us": _time_graph(lambda i: kernel(i, tiles), copies=1, launches=20),
                   "phased_us": _time_graph(lambda i: kernel(i, tiles, sync=False), copies=1, launches=20)}
            # each phase kind alone: one launch per layer of it (and the head), no barrier
            for j, name in enumerate(PHASES + ("head",)):
                sel = [cfg.num_layers * PHASES_PER_LAYER] if name == "head" else [
                    layer * PHASES_PER_LAYER + j for layer in range(cfg.num_layers)]
                row[f"{name}_us"] = _time_graph(lambda i, sel=sel: _phases(depth_step, sel, weights, scratch, kv,
                                                                        dec, frames, p, programs, tiles),
                                                copies=1, launches=20)
            out.append(row)
            log(f"{model} rows {m} tiles {row['tiles']}: layers {layers_us:.1f} µs, kernel {row['kernel_us']:.1f}, "
                f"phased {row['phased_us']:.1f}, bound {bound_us:.1f}; " + ", ".join(
                    f"{n} {row[n + '_us']:.1f}" for n in PHASES + ("head",)) + f"; max rel err {err:.2e}")
    return {"header": run_header(), "bandwidth": bw, "rows": out}


def _phases(depth_step, phases: list[int], weights, scratch, kv, dec, frames, p, programs, tiles: dict) -> None:
    """The kernel launched once per phase in `phases` (sync off): a phase kind's time alone."""
    depth_step(weights, scratch, kv.stacked, dec.projected_codes, frames[:, p - 1], dec.code_offsets[p - 1], p,
               dec.rotary.cos, dec.rotary.sin, dec.cfg.rms_norm_eps, dec.cfg.num_heads, dec.cfg.qk_norm, programs,
               sync=False, only=phases, tiles=tiles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="csm", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--row-tiles", default="",
                    help="';'-separated variants of the one-row kernel's tiles (runner/kernels/depth_step.py ROW_TILES), "
                         "e.g. ';gate_up_n=64,gate_up_k=128' (the empty variant: the module's tiles)")
    ap.add_argument("--write-table", default=None, metavar="PATH",
                    help="put this shape into the tuning table's depth section if the one-row kernel won (else take "
                         "it out)")
    add_out_arg(ap, "depth_step")
    args = ap.parse_args()
    res = run(args.model, [int(x) for x in args.rows.split(",")], args.row_tiles.split(";"))
    lines = ["| rows | one-row tiles | layer path µs | kernel µs | one launch a phase µs | bound µs | " + " | ".join(
        f"{n} µs" for n in PHASES + ("head",)) + " |", "| ---: | --- |" + " ---: |" * (4 + len(PHASES) + 1)]
    for r in res["rows"]:
        lines.append(f"| {r['rows']} | {r['tiles']} | {r['layers_us']:.1f} | {r['kernel_us']:.1f} | {r['phased_us']:.1f} | "
                     f"{r['bound_us']:.1f} | " + " | ".join(f"{r[n + '_us']:.1f}" for n in PHASES + ("head",)) + " |")
    write_results(args.out, res, "\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.write_table:
        one = [r for r in res["rows"] if r["rows"] == 1 and r["tiles"] == "default"]
        if not one:
            raise SystemExit("--write-table needs --rows with 1 and the module's tiles (the empty --row-tiles variant)")
        print(write_depth_row(args.write_table, args.model, one[0], torch.cuda.get_device_name()))


def write_depth_row(path: str, model: str, r: dict, gpu: str) -> str:
    """The table at `path` with this shape in its depth section iff the kernel beat the layer path."""
    import json
    from pathlib import Path

    from runner.kernels.tuning import dumps_table

    shape = SHAPES[model]
    key = f"{shape['hidden']}x{shape['inter']}"
    won = r["kernel_us"] < r["layers_us"]
    raw = json.loads(Path(path).read_text())
    depth = raw.get("depth", {})
    rows = sorted(set(depth.get("one_row", ())) - {key} | ({key} if won else set()))
    line = (f"{gpu}, bf16: one-row sub-steps as runner/kernels/depth_row.py where it beat "
            f"the layer path in CUDA graphs (python -m deploy.bench.depth_step --rows 1 --write-table)")
    raw["depth"] = {"provenance": line, "one_row": rows}
    Path(path).write_text(dumps_table(raw))
    return (f"{key} ({model}): kernel {r['kernel_us']:.1f} µs, layer path {r['layers_us']:.1f} µs -> "
            f"{'in' if won else 'not in'} {path}'s depth section")


if __name__ == "__main__":
    main()
