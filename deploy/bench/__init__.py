"""Benchmark entry points, one module per section, each run from the repo root as
`python -m deploy.bench.<name> --help`. Raw results go to `--out`: $OUT when set, else
`.bench/<name>/` (git-ignored). Current figures and the commands that produce them:
docs/performance.md.

  engine       decode step table, bandwidth bound, eager, transformers, profiles, kernel
               variants (variants.py), hidden-state steps, first use after warm-up (first_use.py)
  serving      the real server under N real-time WebSocket TTS streams; in-process TTFA and
               serving-engine profiles
  frontend     the front end alone on an instant fake engine (no GPU)
  codec        SNAC window decode cost and share of GPU time; codec tile shapes
  kernels      decode attention, lm_head, argmax alone; kernel boundary against a grid barrier
               (boundary_probe.py)
  ncu_layer    one decoder layer's kernels for Nsight Compute
  ws_probe     warp-specialised TMA GEMMs against the engine's tiles
  tune         decode GEMM tile sweeps (gemm.py) and the engine on the swept table
  host         the engine step's host bookkeeping (no GPU)
  sampler      the sampler's backends against the sort-based reference (CPU or GPU)
  ab           the acceptance A/B: engine table and 400-stream serving, old code against new,
               alternated in one device call
"""
