"""Qwen3-TTS (12 Hz) talker and code predictor, read from the config.json of a qwen-tts
`Qwen3TTSForConditionalGeneration` folder (docs/qwen3_tts.md §1-2).

Both transformers are Qwen3 decoders (per-head q/k RMSNorm), each described by a plain
`ModelConfig` parsed by the same code as a Qwen3 checkpoint, so runner/models/llama.py's
decoder layers build them unchanged. The talker's MRoPE always gets three identical position
streams, which is plain RoPE (checked against the reference, docs/qwen3_tts.md §1), so its
`mrope_section` is accepted and ignored; any other RoPE scaling is refused. The codec ids, the
speakers and the languages of the prompt are kept beside the two configs, read by
streaming/qwen3_tts_ids.py (the front end reads them there too, without torch).

Layout: `talker_config` holds the talker's fields and `code_predictor_config`; the prompt's text
ids (tts_pad/bos/eos, im_start/end) are top-level fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from runner.config import QWEN3_TTS_ARCHITECTURE, ConfigError, ModelConfig
from streaming.qwen3_tts_ids import Qwen3TtsIds, Qwen3TtsIdsError, need, section

# the decoder fields whose other values change what the layers compute
_REQUIRED = (("hidden_act", "silu"), ("use_sliding_window", False), ("mlp_bias", False))


@dataclass(frozen=True)
class Qwen3TtsConfig(Qwen3TtsIds):
    """The ids the front end reads too (Qwen3TtsIds: codec specials, text ids, speakers,
    languages, K and the vocabularies), and the two decoders' configs."""

    path: str
    talker: ModelConfig  # vocab_size = codec_vocab_size (codec_head's width)
    predictor: ModelConfig  # vocab_size = codebook_size (each group head's width)
    text_vocab_size: int
    text_hidden_size: int  # text_embedding's width (text_projection maps it to the talker's)

    @property
    def predictor_projects(self) -> bool:
        """The code predictor has an input projection (Linear with bias, talker width -> its
        own) where its width differs from the talker's; the Identity otherwise (M:1171)."""
        return self.predictor.hidden_size != self.talker.hidden_size

    @property
    def engine_view(self) -> ModelConfig:
        """The talker as the engine schedules it (EngineConfig.model): its stack's shape (the
        KV cache's), positions named by text ids (every prompt position has one; a generated
        frame is reported as tts_pad, the frame that ends the audio as tts_eos: the view's
        end id, runner/families/qwen3_tts.py)."""
        return replace(self.talker, vocab_size=self.text_vocab_size, eos_token_ids=(self.tts_eos_id,))

    @property
    def table_offsets(self) -> tuple[int, ...]:
        """Row of code 0 of each group in the concatenated codec table [codec_vocab_size +
        (K - 1) * codebook_size, H]: group 0 is the talker's table, group g its own after it."""
        return (0,) + tuple(self.codec_vocab_size + (g - 1) * self.codebook_size
                            for g in range(1, self.num_code_groups))

    @staticmethod
    def from_pretrained(path: str | Path) -> Qwen3TtsConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"model: no config.json in {str(path)!r}")
        return Qwen3TtsConfig.from_dict(json.loads(cfg_file.read_text()), str(path))

    @staticmethod
    def from_dict(raw: dict, path: str = "") -> Qwen3TtsConfig:
        archs = raw.get("architectures") or []
        if QWEN3_TTS_ARCHITECTURE not in archs:
            raise ConfigError(f"model.architectures: {archs!r} does not name {QWEN3_TTS_ARCHITECTURE}")
        try:
            # the ids (and the sections' presence, K, the two vocabularies) as the front end reads them
            ids = Qwen3TtsIds.from_dict(raw)
            talker_raw = section(raw, "talker_config")
            text_vocab_size = int(need(talker_raw, "text_vocab_size", "talker_config."))
            text_hidden_size = int(need(talker_raw, "text_hidden_size", "talker_config."))
        except Qwen3TtsIdsError as e:
            raise ConfigError(str(e)) from None
        k = ids.num_code_groups
        talker = _decoder_config(talker_raw, "talker_config.", path)
        predictor = _decoder_config(talker_raw["code_predictor_config"], "talker_config.code_predictor_config.", path)
        if predictor.max_position_embeddings < k:
            raise ConfigError(f"model config: talker_config.code_predictor_config.max_position_embeddings "
                              f"{predictor.max_position_embeddings} < num_code_groups {k}")
        return Qwen3TtsConfig(**{f.name: getattr(ids, f.name) for f in fields(Qwen3TtsIds)}, path=path,
                              talker=talker, predictor=predictor, text_vocab_size=text_vocab_size,
                              text_hidden_size=text_hidden_size)


def _decoder_config(raw: dict, field: str, path: str) -> ModelConfig:
    """A Qwen3 ModelConfig of the talker or the code predictor; `field` prefixes error messages."""
    for key, ok in _REQUIRED:
        if raw.get(key, ok) not in (ok, None):
            raise ConfigError(f"model config: {field}{key} {raw[key]!r} is not supported ({ok!r} only)")
    scaling = dict(raw.get("rope_scaling") or {})
    # MRoPE: 3 identical position streams equal 1-D RoPE for any section / interleaving
    scaling.pop("mrope_section", None)
    scaling.pop("interleaved", None)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConfigError(f"model config: {field}rope_scaling.rope_type {rope_type!r} is not supported (default only)")
    plain = {key: val for key, val in raw.items() if key not in ("code_predictor_config", "rope_scaling")}
    plain.update(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False, eos_token_id=None,
                 rope_scaling=scaling or None)
    try:
        return ModelConfig.from_dict(plain, path)
    except ConfigError as e:
        raise ConfigError(str(e).replace("model config: ", f"model config: {field}", 1)) from None
