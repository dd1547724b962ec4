"""What a model folder says about itself beyond config.json: the optional `omnistream.json`.

Its `codec` section (the rest is the front end's speech profile) selects the codec stage:
    "codec": {"path": "snac" | "/abs/snac_24khz", "audio_token_offset": 128266,
              "codebook_size": 4096, "end_token_id": 128258}
Without the file, a codec path given on the command line gets Orpheus-3B's token layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

PROFILE_FILE = "omnistream.json"


def read_profile(model_path: str | Path) -> dict:
    f = Path(model_path) / PROFILE_FILE
    return json.loads(f.read_text()) if f.is_file() else {}


def codec_config_for(model_path: str | Path, codec_path: str | None):
    """-> CodecConfig or None when the model has no codec."""
    from runner.codecs.snac import CodecConfig

    section = dict(read_profile(model_path).get("codec") or {})
    path = codec_path or section.pop("path", None)
    section.pop("path", None)
    if path is None:
        return None
    p = Path(path)
    if not p.is_absolute():
        p = (Path(model_path) / p) if (Path(model_path) / p).exists() else p
    return CodecConfig(path=str(p), **section)


def load_codec_for(model_path: str | Path, codec_path: str | None, device: torch.device,
                   dtype: torch.dtype = torch.float32):
    from runner.codecs.snac import CodecStage

    cfg = codec_config_for(model_path, codec_path)
    return CodecStage(cfg, device, dtype) if cfg is not None else None
