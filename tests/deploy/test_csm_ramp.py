"""deploy.bench.csm_ramp's workload on the CPU (a tiny CSM and its codec): every session's two
sentences run to the end, the second started when the first finishes."""

from __future__ import annotations

from deploy.bench.csm_ramp import build, run


def test_every_session_speaks_both_sentences() -> None:
    eng, prompts = build(cpu=True, max_num_seqs=8)
    steps, finished = run(eng, prompts, sessions=5, per_step=2, frames=4, hang_s=120)
    assert finished == 10
    assert steps >= 2 * 4  # two sentences of 4 frames each, one after the other
    assert not eng.has_unfinished and not eng.requests
