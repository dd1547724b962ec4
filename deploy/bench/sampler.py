"""Sampler micro-benchmark: the sort-based reference (tests/layers/test_sampler.py::OldSampler) against
the sort-free backends of runner/layers/sampler.py, on the Orpheus vocabulary and sampling settings.

One sampling step = penalties (repetition 1.1 over a 100-token prompt + outputs) + bias (EOS
banned, as while min_tokens is unmet) + temperature 0.6 + top-p 0.8 + the exponential race, on
[B, 156940] float32 logits, for B in 1, 64, 256 and two shapes of logits:
  flat    random-weight model: nearly uniform, the nucleus is ~80% of the vocabulary;
  peaked  a trained LM: a handful of tokens hold most of the mass.
'greedy' is the argmax the sampler costs nothing beyond (the all-greedy fast path).

Backends: old (sort), torch (radix select), triton (CUDA only). Each new backend is checked
against the old one on the same data: 'kept' = rows whose kept set equals the reference's
(a different row is only allowed at an fp32 rounding tie of the cumulative mass), 'ids' = rows
drawing the same token from the same race noise.

    python -m deploy.bench.sampler                        # CPU: small rep count
    python -m deploy.bench.sampler --device cuda --sweep  # GPU: + triton launch-config sweep

Prints a markdown table; the raw numbers go to results.json in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from deploy.bench.common import add_out_arg
from runner.layers.sampler import Sampler, SamplingBatch, SlotState
from streaming.sampling_params import SamplingParams
from tests.layers.test_sampler import OldSampler  # the reference implementation

VOCAB = 156940
EOS = 128258
ORPHEUS = dict(temperature=0.6, top_p=0.8, repetition_penalty=1.1)

# triton launch configurations tried by --sweep (the first is the module default).
# num_warps applies when B > the SM count, num_warps_small otherwise.
SWEEP = [
    {},
    {"BLOCK_P": 1024},
    {"BLOCK_P": 256},
    {"NP": 4},
    {"NP": 4, "BLOCK_P": 1024},
    {"NP": 16, "BLOCK_P": 256},
    {"BLOCK_S": 1024},
    {"BLOCK_S": 4096},
    {"C": 4096},
    {"C": 16384},
    {"num_warps": 4, "num_warps_small": 8},
    {"num_warps": 16, "num_warps_small": 32},
]


def make_logits(kind: str, b: int, v: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v, generator=g)
    if kind == "flat":
        x *= 0.02
    else:
        x *= 2.0
        x[:, :64] += 10.0 * torch.rand(b, 64, generator=g)
    return x.to(device)


def make_state(b: int, v: int, device: torch.device, outputs: int = 20) -> SlotState:
    st = SlotState(b, v, 64, device)
    g = torch.Generator().manual_seed(1)
    for s in range(b):
        st.admit(s, torch.randint(0, v, (100,), generator=g).tolist(), [], track_penalties=True)
    for step in range(outputs):
        toks = torch.randint(0, v, (b,), generator=g).to(device)
        st.record(torch.arange(b, device=device), toks, torch.full((b,), step, device=device))
    return st


def make_batch(b: int, device: torch.device) -> SamplingBatch:
    params = [SamplingParams(**ORPHEUS)] * b
    return SamplingBatch.build(params, list(range(b)), list(range(b)), [0] * b, [(i, EOS, float("-inf")) for i in range(b)], device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(fn, logits: torch.Tensor, reps: int, warmup: int) -> float:
    """Median ms of fn(x) with x a fresh copy of logits (the copy is not timed)."""
    device = logits.device
    x = torch.empty_like(logits)
    times = []
    for i in range(warmup + reps):
        x.copy_(logits)
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x)
            end.record()
            end.synchronize()
            t = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn(x)
            t = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(t)
    return statistics.median(times)


def kept_rows_equal(ours: torch.Tensor, ref: torch.Tensor, scaled: torch.Tensor, p: float) -> int:
    """Rows whose kept sets agree, counting a row as agreeing when the only differences are
    tokens whose mass above sits within 1e-5 * Z of the bound (fp64: rounding ties)."""
    ok = 0
    for i in range(ours.shape[0]):
        mine, theirs = torch.isfinite(ours[i]), torch.isfinite(ref[i])
        differ = (mine ^ theirs).nonzero().flatten()
        if differ.numel() == 0:
            ok += 1
            continue
        if differ.numel() > 32:
            continue
        y = scaled[i].double()
        e = (y - y.max()).exp()
        z = e.sum()
        ok += all(abs(float(e[y > y[t]].sum() / z) - p) < 1e-5 for t in differ.tolist())
    return ok


def bench(device: torch.device, batches: list[int], kinds: list[str], backends: list[str], reps: int, warmup: int,
          check: bool) -> list[dict]:
    rows = []
    for kind in kinds:
        for b in batches:
            logits = make_logits(kind, b, VOCAB, device)
            batch = make_batch(b, device)
            st = make_state(b, VOCAB, device)
            res: dict = {"kind": kind, "B": b}
            res["greedy"] = time_step(lambda x: x.argmax(dim=-1), logits, reps, warmup)
            samplers = {"old": OldSampler(device)}
            for name in backends:
                if name != "old":
                    samplers[name] = Sampler(device, backend=name)
            for name, smp in samplers.items():
                if name not in backends:
                    continue
                # State stays fixed (no record) so every rep does identical work.
                res[name] = time_step(lambda x, smp=smp: smp(x, batch, st), logits, reps, warmup)
                print(f"  {kind:6s} B={b:3d} {name:6s} {res[name]:9.2f} ms", file=sys.stderr, flush=True)
            if check and "old" in backends:
                ref_proc = samplers["old"].process(logits.clone(), batch, st).cpu()
                ref_ids = OldSampler(device)(logits.clone(), batch, st).cpu()
                scaled = logits.clone()
                OldSampler._penalize_and_bias(scaled, batch, st)
                scaled = (scaled / ORPHEUS["temperature"]).cpu()
                for name in backends:
                    if name == "old":
                        continue
                    proc = Sampler(device, backend=name).process(logits.clone(), batch, st).cpu()
                    ids = Sampler(device, backend=name)(logits.clone(), batch, st).cpu()
                    res[f"{name}_kept"] = kept_rows_equal(proc, ref_proc, scaled, ORPHEUS["top_p"])
                    res[f"{name}_ids"] = int((ids == ref_ids).sum())
            rows.append(res)
    return rows


def sweep(device: torch.device, batches: list[int], kinds: list[str], reps: int, warmup: int) -> list[dict]:
    """Step time per sampling launch configuration: the untuned one with each SWEEP entry's fields
    replaced, given to the sampler as its tables (the engine's come from load_tables)."""
    import dataclasses

    from runner.kernels.tuning import GENERIC

    out = []
    for cfg in SWEEP:
        tables = dataclasses.replace(GENERIC, sampling=dataclasses.replace(GENERIC.sampling, **cfg))
        try:
            for kind in kinds:
                for b in batches:
                    logits = make_logits(kind, b, VOCAB, device)
                    batch = make_batch(b, device)
                    st = make_state(b, VOCAB, device)
                    smp = Sampler(device, backend="triton", tables=tables)
                    ms = time_step(lambda x: smp(x, batch, st), logits, reps, warmup)
                    out.append({"cfg": json.dumps(cfg) if cfg else "default", "kind": kind, "B": b, "ms": ms})
                    print(f"  sweep {out[-1]['cfg']:32s} {kind:6s} B={b:3d} {ms:8.3f} ms", file=sys.stderr, flush=True)
        except Exception as exc:  # a config that does not compile (registers) must not end the run
            print(f"  sweep {cfg}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--kinds", nargs="+", default=["flat", "peaked"], choices=["flat", "peaked"])
    ap.add_argument("--backends", nargs="+", default=None, help="default: old torch [triton on CUDA]")
    ap.add_argument("--reps", type=int, default=None, help="default 20 on CUDA, 2 on CPU")
    ap.add_argument("--no-check", action="store_true", help="skip the agreement columns")
    ap.add_argument("--sweep", action="store_true", help="also time triton launch configurations (CUDA)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    add_out_arg(ap, "sampler")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    backends = args.backends or (["old", "torch", "triton"] if cuda else ["old", "torch"])
    reps = args.reps or (20 if cuda else 2)
    warmup = 3 if cuda else 1
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({torch.get_num_threads()} threads)"
    rows = bench(device, args.batches, args.kinds, backends, reps, warmup, check=not args.no_check)
    sweep_rows = sweep(device, args.batches, args.kinds, reps, warmup) if args.sweep and cuda else []

    print(f"\n### Sampler step, V={VOCAB}, Orpheus settings (T 0.6, top-p 0.8, repetition 1.1), {name}\n")
    print("median ms per step (penalties + bias + filters + draw; 'greedy' = argmax alone). "
          "speedup = old / new; kept / ids = rows agreeing with old (see docstring).\n")
    new = [n for n in backends if n != "old"]
    head = ["logits", "B", "greedy"] + backends + [f"{n} speedup" for n in new if "old" in backends]
    if not args.no_check and "old" in backends:
        head += [f"{n} kept" for n in new] + [f"{n} ids" for n in new]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["kind"], str(r["B"]), f"{r['greedy']:.3f}"] + [f"{r[n]:.3f}" for n in backends]
        if "old" in backends:
            cells += [f"{r['old'] / r[n]:.1f}x" for n in new]
        if not args.no_check and "old" in backends:
            cells += [f"{r[f'{n}_kept']}/{r['B']}" for n in new] + [f"{r[f'{n}_ids']}/{r['B']}" for n in new]
        print("| " + " | ".join(cells) + " |")
    if sweep_rows:
        print("\n### triton launch configurations (median ms per step)\n")
        keys = sorted({(r["kind"], r["B"]) for r in sweep_rows}, key=lambda k: (k[0], k[1]))
        cfgs = list(dict.fromkeys(r["cfg"] for r in sweep_rows))
        print("| config | " + " | ".join(f"{k} B={b}" for k, b in keys) + " |")
        print("|" + "---|" * (len(keys) + 1))
        for c in cfgs:
            vals = {(r["kind"], r["B"]): r["ms"] for r in sweep_rows if r["cfg"] == c}
            print(f"| {c} | " + " | ".join(f"{vals[k]:.3f}" if k in vals else "-" for k in keys) + " |")
    raw = json.dumps({"device": name, "rows": rows, "sweep": sweep_rows}, indent=1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(raw)
    if args.json:
        args.json.write_text(raw)


if __name__ == "__main__":
    main()
