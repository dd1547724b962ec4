"""Driving an engine in process over a few requests, as the frame-engine tests (CPU and GPU) do,
and an engine built and warmed up as the server does it (ServedEngine)."""

from __future__ import annotations

import numpy as np

from runner.engine.engine import Engine


def drive_requests(engine: Engine, prompts, sampling, join_every: int = 0, audio: bool = False,
                   extra: list[dict] | None = None) -> dict[str, dict]:
    """Add prompt i at step i * join_every (with extra[i]: more add_request arguments, e.g.
    prompt_frames); collect each request's frames, ids, PCM and (finish reason, error)."""
    got = {f"r{i}": {"ids": [], "frames": [], "pcm": [], "finish": None} for i in range(len(prompts))}
    pending, step = list(enumerate(prompts)), 0
    while pending or engine.has_unfinished:
        while pending and step >= pending[0][0] * join_every:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, sampling[i] if isinstance(sampling, list) else sampling, audio=audio,
                               **(extra[i] if extra else {}))
        for o in engine.step():
            g = got[o.request_id]
            g["ids"] += o.new_token_ids
            if o.frames is not None:
                assert o.frames.shape == (len(o.new_token_ids), engine.family.codes_per_frame)
                g["frames"].append(o.frames)
            if o.audio is not None:
                g["pcm"].append(o.audio)
            if o.finished:
                g["finish"] = (o.finish_reason, o.error)
        step += 1
    for g in got.values():
        g["frames"] = np.concatenate(g["frames"]) if g["frames"] else np.zeros((0, engine.family.codes_per_frame), np.int64)
    return got


class ServedEngine:
    """An engine built as the server builds it (its family's codec included) and warmed up as
    the server warms it up, with helpers to drive requests and, inside `with`, a record of every
    Triton compile after the warm-up (the GPU tests that serving compiles nothing)."""

    def __init__(self, model_path, max_num_seqs: int = 16, max_model_len: int = 1024):
        from runner.engine.args import engine_args
        from runner.engine.process import build_engine

        self.eng = build_engine(engine_args(str(model_path), max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                            device="cuda"))
        self.eng.warm_up()
        self.compiled: list[str] = []  # while inside `with`: runner.engine.compile_log.recording's list

    def prompt(self, n: int, salt: int) -> list[int]:
        from tests.engine.test_engine import prompts_of

        return prompts_of([n], self.eng.cfg.model.vocab_size, seed=salt)[0]

    def run(self, steps: int | None = None) -> None:
        n = 0
        while self.eng.has_unfinished and (steps is None or n < steps):
            self.eng.step()
            n += 1

    def __enter__(self) -> "ServedEngine":
        from runner.engine.compile_log import recording

        self._recording = recording()
        self.compiled = self._recording.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._recording.__exit__(*exc)
