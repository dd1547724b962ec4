"""Orpheus A/B of the code before a change against this checkout, alternated old, new, old, new on
one GPU machine in one call, under 10 minutes: issue 31's acceptance (the layout redesign, old =
d06bc56) and issue 33's "Orpheus unchanged" (multi-codebook frames, old = 9346da1, the last
commit before it; `--old-commit`).

Per round, each in its own process: the engine table (greedy decode ms/step at batch 1..256,
CUDA graphs + async scheduling, `decode` section, with the copy bandwidth) from the old code,
then from the new; then the serving benchmark (the real server, 400 WebSocket TTS streams
starting together and read in real time: TTFA p50 / p99, underruns, errors) from the old code,
then from the new. Two rounds by default. Each side runs its own scripts: an old checkout of the
flat layout `deploy/bench_gpu.py` in `.ab/old`, one of the package layout (and the new side)
`python -m deploy.bench.engine` / `.serving`.
Raw results land in $OUT/ab/<side><round>-<engine|serving>/; the one results file is
$OUT/ab.md (with ab.json beside it), rewritten after every run so a cut-off call still
reports what finished.

Here (with git), once:

    python3 -m deploy.bench.ab --prepare --wheels-from /work/shared/gpu-wheels

writes the old code (runner / streaming / server / deploy of `--old-commit`) into
`.ab/old` and the msgspec / pyzmq / snac wheels into `.whl/` (both git-ignored). Then on the GPU
machine, carrying `.ab` and `.whl`:

    python3 -m deploy.bench.ab

`--dry-run` prints the commands without running them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OLD_COMMIT = "9346da1"  # the last commit before issue 33 (frames through the engine); issue 31's: d06bc56
OLD_PATHS = ["runner", "streaming", "server", "deploy"]
ENGINE_BATCHES = "1,8,16,32,48,64,128,256"
SERVING = ["--streams", "400", "--serving-max-seqs", "512", "--serving-ramp-s", "0", "--serving-admission-wait-ms", "20"]
# seconds a run is expected to take at most on the H200 (compiles included); a run that would
# not fit in the remaining budget is skipped and marked so in ab.md
EXPECTED_S = {"engine": 100, "serving": 90}


def prepare(commit: str, old: Path, wheels_from: str | None) -> None:
    """The old code into `old` (git archive of `commit`), wheels into .whl/."""
    if old.exists():
        shutil.rmtree(old)
    old.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit, *OLD_PATHS], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    print(f"{old}: the code of {commit}")
    if wheels_from:
        dest = ROOT / ".whl"
        dest.mkdir(exist_ok=True)
        for w in Path(wheels_from).glob("*.whl"):
            shutil.copy(w, dest / w.name)
            print(f"{dest / w.name}")


def site_path(wheels: Path, dry_run: bool) -> str:
    """A site folder with the wheels the GPU image lacks (msgspec, pyzmq, snac), installed once;
    '' when they import already."""
    probe = subprocess.run([sys.executable, "-c", "import msgspec, zmq, snac"], capture_output=True, check=False)
    if probe.returncode == 0 or dry_run:
        return ""
    site = Path("/tmp/ab-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    *map(str, sorted(wheels.glob("*.whl")))], check=True)
    return str(site)


def commands(side: str, kind: str, old: Path, batches: str, out: Path) -> tuple[list[str], Path]:
    """(argv, cwd) of one run."""
    if side == "old" and not (old / "deploy" / "bench" / "engine.py").exists():  # the flat layout
        sections = ["--sections", "bandwidth,decode", "--batches", batches] if kind == "engine" else ["--sections", "serving", *SERVING]
        return [sys.executable, "deploy/bench_gpu.py", *sections, "--out", str(out)], old
    root = old if side == "old" else ROOT
    if kind == "engine":
        return [sys.executable, "-m", "deploy.bench.engine", "--sections", "bandwidth,decode", "--batches", batches,
                "--out", str(out)], root
    return [sys.executable, "-m", "deploy.bench.serving", "--sections", "serving", *SERVING, "--out", str(out)], root


def serving_row(table: str, streams: int = 400) -> dict:
    """TTFA p50 / p99 ms, underruns and errors of the `streams` row of `omnistream bench`'s table."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 13 and cells[0] == str(streams):
            return {"ttfa_p50_ms": float(cells[2]), "ttfa_p99_ms": float(cells[3]), "rtf_max": cells[5],
                    "underruns": cells[9], "errors": cells[11], "real_time": cells[12]}
    return {}


def read_run(kind: str, out: Path) -> dict:
    """The figures ab.md compares, from one run's results.json."""
    res = json.loads((out / "results.json").read_text())
    if kind == "engine":
        return {"bandwidth_TBps": res.get("bandwidth_Bps", 0) / 1e12,
                "step_ms": {str(b): r["step_ms"] for b, r in res["engine"].items()}}
    return serving_row(res["serving"][0]["table"])


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def render(runs: list[dict], batches: str, old_commit: str) -> str:
    lines = ["# A/B: the code before a change (old) against this checkout (new)", "",
             "Alternated in one call, each run its own process; old = " + old_commit + ".", ""]
    eng = [r for r in runs if r["kind"] == "engine" and "figures" in r]
    if eng:
        lines += ["Engine, greedy decode ms/step (CUDA graphs + async scheduling, 100-token prompts, 500 new tokens):", "",
                  "| batch | " + " | ".join(r["label"] for r in eng) + " | old mean | new mean | new vs old |",
                  "| ---: |" + " ---: |" * (len(eng) + 3)]
        for b in batches.split(","):
            vals = {r["label"]: r["figures"]["step_ms"].get(b) for r in eng}
            old = mean([v for k, v in vals.items() if k.startswith("old") and v is not None])
            new = mean([v for k, v in vals.items() if k.startswith("new") and v is not None])
            lines.append(f"| {b} | " + " | ".join(f"{v:.3f}" if v is not None else "" for v in vals.values())
                         + f" | {old:.3f} | {new:.3f} | {100 * (new / old - 1):+.1f}% |")
        lines += ["", "copy bandwidth TB/s: " + ", ".join(f"{r['label']} {r['figures']['bandwidth_TBps']:.2f}" for r in eng), ""]
    srv = [r for r in runs if r["kind"] == "serving" and r.get("figures")]
    if srv:
        lines += ["Serving, 400 real-time WebSocket TTS streams starting together:", "",
                  "| run | TTFA p50 ms | TTFA p99 ms | RTF max | underruns (streams) | errors | real time |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | :---: |"]
        for r in srv:
            f = r["figures"]
            lines.append(f"| {r['label']} | {f['ttfa_p50_ms']:.0f} | {f['ttfa_p99_ms']:.0f} | {f['rtf_max']} | {f['underruns']} "
                         f"| {f['errors']} | {f['real_time']} |")
        old = mean([r["figures"]["ttfa_p99_ms"] for r in srv if r["label"].startswith("old")])
        new = mean([r["figures"]["ttfa_p99_ms"] for r in srv if r["label"].startswith("new")])
        lines += ["", f"TTFA p99 mean: old {old:.0f} ms, new {new:.0f} ms ({100 * (new / old - 1):+.1f}%)", ""]
    for r in runs:
        if "figures" not in r or not r["figures"]:
            lines.append(f"- {r['label']}: {r.get('error', 'no figures')}")
    lines += ["", "Runs: " + ", ".join(f"{r['label']} {r.get('wall_s', 0):.0f} s" for r in runs)]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true", help="write .ab/old from git (and .whl/ with --wheels-from), then stop")
    ap.add_argument("--old-commit", default=OLD_COMMIT)
    ap.add_argument("--wheels-from", default=None, help="--prepare: a folder of msgspec / pyzmq / snac wheels to copy into .whl/")
    ap.add_argument("--old", default=str(ROOT / ".ab" / "old"), help="the old checkout")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", default=ENGINE_BATCHES)
    ap.add_argument("--kinds", default="engine,serving", help="which runs of a round: engine, serving or both")
    ap.add_argument("--budget-s", type=float, default=570, help="skip runs that would end past this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / ".bench"))
    args = ap.parse_args()
    old = Path(args.old).resolve()
    if args.prepare:
        prepare(args.old_commit, old, args.wheels_from)
        return 0
    if not (old / "runner").exists() and not args.dry_run:
        sys.exit(f"{old}: no old checkout; run `python3 -m deploy.bench.ab --prepare` where git is, and carry .ab")
    t_start = time.perf_counter()
    site = site_path(ROOT / ".whl", args.dry_run)
    out = Path(args.out)
    runs: list[dict] = []
    plan = [(kind, side, i) for i in range(1, args.rounds + 1) for kind in args.kinds.split(",") for side in ("old", "new")]
    for kind, side, i in plan:
        label = f"{side}{i}"
        run_out = out / "ab" / f"{label}-{kind}"
        argv, cwd = commands(side, kind, old, args.batches, run_out)
        run = {"kind": kind, "label": label, "command": " ".join(argv), "cwd": str(cwd)}
        runs.append(run)
        if args.dry_run:
            print(f"(cd {cwd} && {' '.join(argv)})")
            continue
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < EXPECTED_S[kind]:
            run["error"] = f"skipped: {left:.0f} s of the budget left"
            continue
        # each side imports its own packages; the new side's generated model folders go under
        # its own TMPDIR (the old code writes fixed /tmp paths)
        # (wheels installed by the caller into a site folder on PYTHONPATH stay reachable, after the side's own root)
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(cwd), site, *inherited])), OUT=str(run_out))
        if side == "new":
            env["TMPDIR"] = "/tmp/ab-new"
            Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
        run_out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(run_out / "log.txt", "wb") as logf:
            try:
                subprocess.run(argv, cwd=cwd, env=env, stdout=logf, stderr=subprocess.STDOUT, check=True, timeout=left)
                run["figures"] = read_run(kind, run_out)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as e:
                run["error"] = f"{type(e).__name__}: {e}"[:300]
        run["wall_s"] = time.perf_counter() - t0
        print(f"{label} {kind}: {run['wall_s']:.0f} s {run.get('error', '')}", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ab.json").write_text(json.dumps(runs, indent=1))
        (out / "ab.md").write_text(render(runs, args.batches, args.old_commit))
    if not args.dry_run:
        print((out / "ab.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
