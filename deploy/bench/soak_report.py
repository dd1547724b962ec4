"""The soak's figures, report and verdict (deploy/bench/soak.py)."""

from __future__ import annotations

from dataclasses import asdict

from deploy.bench.soak_server import Config, Outcome

# ---- the figures --------------------------------------------------------------------------------------


MIN_WINDOW_SAMPLES = 5  # sessions on each side before the stalled-reader comparison is judged


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def rss_growth(curve: list, col: int) -> dict:
    """Retained growth after warm-up: the lowest RSS of the last 20% of samples minus the lowest
    of the 20%-40% window (the first 20% is warm-up: caches, arenas, first compiles). Lows, not
    medians: a long prefill's transient working set (GBs on the CPU) is not a leak; what stays
    after it is."""
    ys = [row[col] for row in curve if row[col] is not None]
    if len(ys) < 5:
        return {"samples": len(ys), "growth_mb": None}
    n = len(ys)
    base = min(ys[n // 5: max(n // 5 + 1, 2 * n // 5)])
    end = min(ys[-max(1, n // 5):])
    return {"samples": n, "start_mb": round(ys[0], 1), "warm_mb": round(base, 1), "end_mb": round(end, 1),
            "max_mb": round(max(ys), 1), "growth_mb": round(end - base, 1)}


def summarize(cfg: Config, outcomes: list[Outcome], curve: list, final: dict, wall: float,
              stall_windows: list[tuple[float, float]], control_windows: list[tuple[float, float]]) -> dict:
    by_kind: dict[str, dict] = {}
    for o in outcomes:
        k = by_kind.setdefault(o.kind, {"sessions": 0, "ok": 0, "failed": 0, "refused": 0, "chunks": 0})
        k["sessions"] += 1
        k["ok"] += o.ok
        k["failed"] += not o.ok and not o.refused
        k["refused"] += o.refused
        k["chunks"] += o.chunks

    def within(o: Outcome, windows: list[tuple[float, float]]) -> bool:
        return any(a < o.started + (o.ttfa_s or 0) and o.started < b for a, b in windows)

    ttfas = [o for o in outcomes if o.ok and o.kind in ("stream", "http") and o.ttfa_s is not None]
    with_stall = [o.ttfa_s for o in ttfas if within(o, stall_windows)]
    control = [o.ttfa_s for o in ttfas if within(o, control_windows) and not within(o, stall_windows)]
    quiet = [o.ttfa_s for o in ttfas if not within(o, stall_windows + control_windows)]
    p95_with, p95_control = _pct(with_stall, 0.95), _pct(control, 0.95)
    # A p95 of a handful of sessions is one session's luck (on a loaded CPU one long prefill
    # decides it): judge only with MIN_WINDOW_SAMPLES on both sides, else say "not measured".
    starved = None
    if len(with_stall) >= MIN_WINDOW_SAMPLES and len(control) >= MIN_WINDOW_SAMPLES:
        starved = p95_with > max(2.0 * p95_control, p95_control + 1.0)
    without = control + quiet
    front, engine = rss_growth(curve, 1), rss_growth(curve, 2)
    failures = [f"{o.kind}: {o.error}" for o in outcomes if not o.ok and not o.refused]
    return {
        "config": asdict(cfg),
        "wall_s": round(wall, 1),
        "sessions": len(outcomes),
        "sessions_per_s": round(len(outcomes) / wall, 2) if wall else None,
        "ok": sum(o.ok for o in outcomes),
        "failed": len(failures),
        "refused": sum(o.refused for o in outcomes),
        "failures": failures[:20],
        "by_kind": by_kind,
        "ttfa_s": {"p50": _pct(without + with_stall, 0.5), "p95": _pct(without + with_stall, 0.95),
                   "max": _pct(without + with_stall, 1.0),
                   "p95_while_stalled": p95_with, "p95_same_work_read": p95_control, "p95_quiet": _pct(quiet, 0.95),
                   "n_while_stalled": len(with_stall), "n_same_work_read": len(control), "n_quiet": len(quiet),
                   "starved": starved},
        "rss": {"front_end": front, "engine": engine,
                "bound_mb": cfg.rss_growth_mb,
                "flat": all(g.get("growth_mb") is not None and g["growth_mb"] <= cfg.rss_growth_mb for g in (front, engine))},
        "rss_curve": curve,  # (t_s, front-end MB, engine MB, sessions done)
        "engine_at_end": final,
    }


def render(res: dict) -> str:
    cfg, t, rss = res["config"], res["ttfa_s"], res["rss"]
    lines = [
        f"# Soak ({res.get('date', '')}, {res.get('machine', '')})", "",
        f"`{res.get('command', '')}`", "",
        (f"{res['sessions']} sessions in {res['wall_s']} s ({res['sessions_per_s']}/s), concurrency {cfg['concurrency']}: "
         f"{res['ok']} ok, {res['failed']} failed, {res['refused']} refused"), "",
        "| kind | sessions | ok | failed | refused | chunks |", "| --- | --- | --- | --- | --- | --- |",
        *[f"| {k} | {v['sessions']} | {v['ok']} | {v['failed']} | {v['refused']} | {v['chunks']} |" for k, v in sorted(res["by_kind"].items())],
        "",
        (f"TTFA (stream + http): p50 {t['p50']} s, p95 {t['p95']} s, max {t['max']} s; p95 while readers were stalled "
         f"{t['p95_while_stalled']} s (n={t['n_while_stalled']}) vs {t['p95_same_work_read']} s while the same requests "
         f"were read (n={t['n_same_work_read']}), {t['p95_quiet']} s without either (n={t['n_quiet']}): "
         f"starved={t['starved']}"), "",
        (f"RSS growth after warm-up (bound {rss['bound_mb']} MB): front end {rss['front_end']}, engine {rss['engine']}: "
         f"flat={rss['flat']}"), "",
        "| t (s) | front end (MB) | engine (MB) | sessions done |", "| --- | --- | --- | --- |",
    ]
    curve = res["rss_curve"]
    step = max(1, len(curve) // 12)
    lines += [f"| {r[0]} | {r[1] and round(r[1], 1)} | {r[2] and round(r[2], 1)} | {r[3]} |" for r in curve[::step]]
    e = res["engine_at_end"]
    lines += ["", (f"Engine at the end: running {e['num_running']}, waiting {e['num_waiting']}, free blocks "
                   f"{e['num_free_blocks']}/{e['num_total_blocks']}, codec streams {e.get('num_codec_streams')}, "
                   f"idle={e['idle']}")]
    sd = res.get("shutdown", {})
    lines += ["", f"SIGTERM: exit {sd.get('exit_code')} in {sd.get('exit_s')} s, tracebacks {sd.get('tracebacks')}"]
    if res["failures"]:
        lines += ["", "Failures (first 20):", *[f"- {f}" for f in res["failures"]]]
    return "\n".join(lines) + "\n"


def verdict(res: dict) -> list[str]:
    """What failed, in words (empty: every property held)."""
    bad = []
    if res["failed"]:
        bad.append(f"{res['failed']} sessions failed: {res['failures'][:3]}")
    if res["refused"]:
        bad.append(f"{res['refused']} sessions refused (429 / overloaded) under the limits")
    if not res["rss"]["flat"]:
        bad.append(f"RSS grew: {res['rss']}")
    if not res["engine_at_end"]["idle"]:
        bad.append(f"engine not idle at the end: {res['engine_at_end']}")
    if res["ttfa_s"]["starved"]:
        bad.append(f"a stalled reader delayed the others: {res['ttfa_s']}")
    sd = res.get("shutdown", {})
    if sd.get("exit_code") != 0 or sd.get("tracebacks"):
        bad.append(f"shutdown: {sd}")
    return bad
