"""What the benchmark entry points share: the Orpheus-3B shape with random weights, the engine
each section builds, the kernel A/B switches, the tile-spec parser, the serving model folder,
the results folder and the life of a real server process (`served`: serving, csm and dp).

Every entry point writes its raw results (results.json, results.md, logs, profiles) into
`--out`: $OUT when set (the device machine hands that folder back), else `.bench/<name>/` at
the repo root (git-ignored).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RunnerConfig,
    SchedulerConfig,
)

ROOT = Path(__file__).resolve().parents[2]

ORPHEUS_3B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 156940,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 128258,
}
BATCHES = [1, 8, 32, 64, 128, 256]
# RunnerConfig kernel options of every engine a run builds (--skinny-linear, --pdl, ...; the
# variants section edits this dict per variant and restores it)
KERNELS = {"skinny_linear": True, "pdl": True, "rope_in_attention": True, "attention_prefetch": True, "split_k": True,
           "norm_fold": True, "qkv_rope": True, "tuning": "auto"}
# --tuned FILE: (kind, N, K) -> rows of a sweep's gemm_tuned.json, replacing the tables' `tuned`
# rows in every model a run builds (bench_tables)
TUNED_ROWS: dict = {}
PROMPT, NEW = 100, 500  # engine sections: prompt tokens and new tokens per request


def log(*a) -> None:
    print(*a, flush=True)


def scratch(name: str) -> Path:
    """A folder for generated model files under $TMPDIR (so two checkouts benchmarked on one
    machine can keep theirs apart by TMPDIR)."""
    return Path(tempfile.gettempdir()) / "omnistream-bench" / name


def add_out_arg(ap: argparse.ArgumentParser, name: str) -> None:
    default = os.environ.get("OUT") or str(ROOT / ".bench" / name)
    ap.add_argument("--out", default=default, help=f"results folder (default: $OUT, else .bench/{name}/)")


def add_kernel_args(ap: argparse.ArgumentParser) -> None:
    """The A/B switches of the decode kernels (RunnerConfig fields), all on by default."""
    ap.add_argument("--tuning", choices=("auto", "none"), default="auto",
                    help="RunnerConfig.tuning: none = the generic tables (cuBLAS GEMMs, default attention, SNAC and "
                         "sampling launches), A/B against the device's table")
    ap.add_argument("--skinny-linear", type=int, default=1, help="0: decode GEMMs in cuBLAS (A/B)")
    ap.add_argument("--pdl", type=int, default=1, help="0: no programmatic dependent launch (A/B)")
    ap.add_argument("--rope-in-attention", type=int, default=1, help="0: RoPE + KV write in their own launch (A/B)")
    ap.add_argument("--split-k", type=int, default=1, help="0: o_proj / down never as split-K partials (A/B)")
    ap.add_argument("--norm-fold", type=int, default=1, help="0: the post-attention RMSNorm always in its own launch (A/B)")


def apply_kernel_args(args: argparse.Namespace) -> None:
    KERNELS.update(skinny_linear=bool(args.skinny_linear), pdl=bool(args.pdl),
                   rope_in_attention=bool(args.rope_in_attention), split_k=bool(args.split_k),
                   norm_fold=bool(args.norm_fold), tuning=args.tuning)


def run_header() -> dict:
    """The first fields of every results.json: when, on what, by which command."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "torch": torch.__version__,
            "command": " ".join(sys.argv)}


def write_results(out: str | Path, res: dict, md: str) -> Path:
    """results.json and results.md into `out`; prints the markdown last."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "results.md").write_text(md)
    print(md)
    return out


def bench_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second: the bound's denominator."""
    n = 2 * 2**30  # 2 GiB per buffer: far above L2
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times)


def engine_config(max_seqs: int, graphs: bool, async_sched: bool) -> EngineConfig:
    m = ModelConfig.from_dict(ORPHEUS_3B, "orpheus-3b-random")
    return EngineConfig(
        model=m,
        cache=CacheConfig(block_size=16, num_blocks=max_seqs * ((PROMPT + NEW) // 16 + 2) + 64),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=8192, max_model_len=2048,
                                  async_scheduling=async_sched),
        runner=RunnerConfig(device="cuda", dtype="bfloat16", cuda_graphs=graphs, max_graph_batch_size=max_seqs,
                            **KERNELS),
    )


def bench_tables():
    """The tuning tables every model of a run is built on: load_tables for KERNELS["tuning"] (the
    device's, or the generic ones), with --tuned's rows (TUNED_ROWS) in place of the `tuned` rows."""
    import dataclasses

    from runner.kernels.tuning import load_tables

    tables = load_tables("cuda", KERNELS["tuning"])
    if TUNED_ROWS:
        tables = dataclasses.replace(tables, linear=dataclasses.replace(tables.linear, tuned=dict(TUNED_ROWS)))
    return tables


def build_orpheus_model(tables=None):
    """The random Orpheus-3B-shaped model (bf16) with the current KERNELS options, its backends
    on `tables` (runner.kernels.tuning.Tables; default: bench_tables())."""
    from runner.layers import make_backends
    from runner.models.llama import build_random_model

    cfg = engine_config(1, True, True)
    attn, ops = make_backends(cfg.runner, tables if tables is not None else bench_tables())
    return build_random_model(cfg.model, "cuda", torch.bfloat16, attn=attn, ops=ops)


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every parameter once (the embedding only for B rows, ~0)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)


def all_decoding(eng) -> bool:
    """Whether the next step is pure decode: nothing waiting and every prompt computed
    (Request.is_prefill would also flag a sync-mode request whose newest token is known but not
    yet computed, so the eager run would time no step)."""
    return not eng.scheduler.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens for r in eng.scheduler.running)


def orpheus_sampling(n: int):
    """Orpheus' sampling settings (not greedy), n new tokens, no early end."""
    from streaming.sampling_params import SamplingParams

    return SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=n, ignore_eos=True, seed=0)


def parse_tile(fields: list[int]):
    """bm, bn, bk, warps, stages[, late_trigger 0/1[, groups[, tma 0/1]]] -> LinearTile (late_trigger
    and tma as the bools they are; groups: ragged column groups, 0 = plain tiles)."""
    from runner.kernels.tuning.tiles import LinearTile

    late = bool(fields[5]) if len(fields) > 5 else False
    groups = fields[6] if len(fields) > 6 else 0
    return LinearTile(*fields[:5], late, groups, bool(fields[7]) if len(fields) > 7 else False)


def random_snac_folder() -> Path:
    """SNAC 24 kHz's architecture with random weights."""
    from runner.models.builders import write_random_snac

    return write_random_snac(scratch("snac24_random"))


def make_orpheus_random_folder(root: Path, snac: Path) -> Path:
    """A model folder the real server can serve: Orpheus-3B's config.json (weights random via
    --random-weights), the embedded default's tokenizer (its ids are valid in this vocab) and
    an omnistream.json with Orpheus-3B's token layout and the random SNAC 24 kHz."""
    import shutil

    from runner.models.default_model import ensure_default_model

    tiny = ensure_default_model(str(scratch("omnistream-cache")))
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(ORPHEUS_3B | {"bos_token_id": 500}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, root / f)
    profile = json.loads((tiny / "omnistream.json").read_text())
    profile.update(prefix_token_ids=[128259], suffix_token_ids=[128009, 128260, 128261, 128257])
    profile["sampling"] = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1, "max_tokens": 1200,
                           "stop_token_ids": [128258]}
    profile["codec"] = {"path": str(snac), "audio_token_offset": 128266, "codebook_size": 4096, "end_token_id": 128258}
    (root / "omnistream.json").write_text(json.dumps(profile))
    return root


def serving_model_folder() -> Path:
    """The random Orpheus-3B + SNAC 24 kHz folder that serving, ttfa, profile_serving and
    first_use use."""
    return make_orpheus_random_folder(scratch("orpheus3b-random"), random_snac_folder())


def in_process_engine(max_num_seqs: int):
    """The serving engine (as `serve` builds it, random weights) in this process."""
    from runner.engine.args import engine_args
    from runner.engine.process import build_engine

    return build_engine(engine_args(str(serving_model_folder()), device="cuda", max_num_seqs=max_num_seqs,
                                    max_model_len=1024, random_weights=True))


# ---- a real server process (serving, csm and dp start `omnistream serve`) ------------------------

SERVE = (sys.executable, "-m", "server.cli", "serve")  # `-m` imports from the process's cwd first


def free_port() -> int:
    """A loopback port nobody listens on right now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    """(status, JSON body) of a GET, error statuses included; no connection raises OSError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def serve_command(port: int, args: Sequence[str], program: Sequence[str] = SERVE) -> list[str]:
    """The command `served` runs: `program --port PORT *args` (a later --port in args would win)."""
    return [*program, "--port", str(port), *args]


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return "<no log>"


@dataclass(frozen=True)
class Served:
    proc: subprocess.Popen  # the server; its session holds the engines it starts
    port: int
    url: str  # http://127.0.0.1:PORT
    log_path: Path
    up_s: float  # from the start to the first ready /health


@contextlib.contextmanager
def served(args: Sequence[str], log_path: Path, *, port: int | None = None, program: Sequence[str] = SERVE,
           cwd: Path | str = ROOT, env: dict[str, str] | None = None, timeout_s: float = 400.0,
           ready: Callable[[dict], bool] = lambda body: True, stop_s: float = 30.0) -> Iterator[Served]:
    """Run `program --port PORT *args` (PORT: a free loopback port unless given) in its own session
    from `cwd`, stdout and stderr into `log_path` (`env`: None inherits this process's), and
    yield it once GET /health answers 200 with a JSON body `ready` accepts. The process exiting
    first, or `timeout_s` passing, raises RuntimeError with the log's tail. On exit, however the
    block ends: SIGTERM to the server (it stops its engines itself), SIGKILL to its whole session
    after `stop_s` or to whatever it left there."""
    port = free_port() if port is None else port
    url, log_path = f"http://127.0.0.1:{port}", Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(serve_command(port, args, program), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            t0 = time.monotonic()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with code {proc.returncode} before it was ready "
                                       f"({log_path}):\n{log_tail(log_path)}")
                with contextlib.suppress(OSError, ValueError):  # not listening yet, or not JSON
                    status, body = http_json(url + "/health", timeout=2.0)
                    if status == 200 and ready(body):
                        break
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"server not ready within {timeout_s:.0f} s ({log_path}):\n{log_tail(log_path)}")
                time.sleep(0.2)
            yield Served(proc, port, url, log_path, time.monotonic() - t0)
        finally:
            stop_session(proc, stop_s)


def stop_session(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to `proc` and `grace_s` to exit, then SIGKILL to its session's process group:
    `proc` if it hung, and any child it left (an engine orphaned by a killed server would hold
    its GPU)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
