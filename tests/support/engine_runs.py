"""Driving an engine in process over a few requests, as the frame-engine tests (CPU and GPU) do."""

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
