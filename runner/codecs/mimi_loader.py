"""The Mimi codec from a local folder: a MimiModel checkpoint (save_pretrained's layout) or the
codec inside a CSM checkpoint, checked for what the streaming decoder (runner/codecs/mimi.py)
needs, and where its decoder modules sit in either transformers 5.x layout."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import MimiConfig, MimiModel
from transformers.models.mimi.modeling_mimi import MimiConvTranspose1d, MimiDecoder, MimiTransformerModel

from runner.codecs.config import CodecError


def load_mimi(source: str | Path | MimiModel, device: torch.device, dtype: torch.dtype = torch.float32) -> MimiModel:
    """A MimiModel from a local folder (config.json + safetensors, as save_pretrained writes it) or
    an already built one (CSM's `codec_model`), in eval mode on `device`; checks that its decoder
    can stream (see the module doc), naming the config field otherwise."""
    if isinstance(source, MimiModel):
        model = source
    else:
        path = Path(source)
        if not (path / "config.json").is_file():
            raise CodecError(f"Mimi codec path: no config.json in {str(path)!r}")
        model = MimiModel.from_pretrained(path, dtype=dtype, local_files_only=True)
    cfg = model.config
    if model.decoder is None:
        raise CodecError("MimiConfig.decoder_config: the codec has no decoder")
    checks = (
        ("use_causal_conv", cfg.use_causal_conv, True),
        ("pad_mode", cfg.pad_mode, "constant"),
        ("trim_right_ratio", cfg.trim_right_ratio, 1.0),
        ("audio_channels", cfg.audio_channels, 1),
    )
    for name, got, want in checks:
        if got != want:
            raise CodecError(f"MimiConfig.{name}: streaming decode needs {want!r}, got {got!r}")
    if not cfg.sliding_window or cfg.sliding_window < 1:
        raise CodecError(f"MimiConfig.sliding_window: streaming decode needs a window >= 1, got {cfg.sliding_window!r}")
    return model.to(device=device, dtype=dtype).eval()


_CSM_CODEC = "codec_model."  # CsmForConditionalGeneration's codec tensors


def load_csm_codec(path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32) -> MimiModel:
    """The Mimi codec at `path`: a MimiModel folder, or a CSM folder (CsmForConditionalGeneration
    keeps its codec as `codec_config` and the `codec_model.*` tensors of its safetensors)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CodecError(f"Mimi codec path: no config.json in {str(path)!r}")
    raw = json.loads(cfg_file.read_text())
    if "codec_config" not in raw:
        return load_mimi(path, device, dtype)
    state = prefixed_tensors(path, _CSM_CODEC)
    if not state:
        raise CodecError(f"codec in {str(path)!r}: the checkpoint holds no {_CSM_CODEC}* tensors")
    with tempfile.TemporaryDirectory() as tmp:
        return load_mimi(write_mimi_folder(tmp, raw["codec_config"], state), device, dtype)


def prefixed_tensors(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of the folder's safetensors named `prefix...`, the prefix removed: a codec
    stored inside another model's checkpoint (CSM's codec_model.*, Qwen3-TTS's encoder.*)."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            state.update({k.removeprefix(prefix): st.get_tensor(k) for k in st.keys() if k.startswith(prefix)})
    return state


def write_mimi_folder(tmp: str, config: dict, state: dict[str, torch.Tensor]) -> str:
    """A MimiModel folder in `tmp` (config.json + model.safetensors) from a config dict and a
    state dict. Why a folder: transformers' loader then maps the checkpoint's names onto its
    modules (it renames several, across versions) and checks them, as for a Mimi checkpoint."""
    MimiConfig(**config).save_pretrained(tmp)
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    return tmp


def decoder_modules(model: MimiModel) -> tuple[MimiConvTranspose1d | None, MimiTransformerModel, nn.ModuleList]:
    """(latent upsampling conv or None, decoder transformer, SEANet layers). transformers 5.2x
    groups them in `model.decoder` (a MimiDecoderModel); earlier 5.x keep the first two on the
    model and `model.decoder` is the SEANet itself (MimiDecoder)."""
    dec = model.decoder
    if isinstance(dec, MimiDecoder):
        return model.upsample, model.decoder_transformer, dec.layers
    return dec.upsample, dec.decoder_transformer, dec.decoder_seanet.layers
