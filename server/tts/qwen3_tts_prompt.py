"""Qwen3-TTS prompts (docs/qwen3_tts.md §1, M:2022-2234): every position's input is a text part
plus a codec part, so a prompt is rows, not a text: `ids` [P] the text id of each position,
`frames` [P][K] its codec part (column 0 a talker codec-table id, -1 where the position reads
none; groups 1..K-1 always -1 here: no reference frames before Stage 5), `step_text_ids` the
trailing text fed one id a generated frame (streaming text mode; [] non-streaming).

Layout, role = `<|im_start|>assistant\\n` (3 ids), T0..Tm-1 the text's ids:
    [instruct ids: text only]  role: text only
    prefix: text tts_pad x (n-1), tts_bos over codec [nothink, think_bos, think_eos] (language
            auto) or [think, think_bos, lang, think_eos], then the speaker, then codec_pad
    non-streaming: T_i over codec_pad, tts_eos over codec_pad, tts_pad over codec_bos
    streaming:     T0 over codec_bos; trailing [T1..Tm-1, tts_eos]
A dialect speaker's dialect replaces the language when the language is chinese or auto
(M:2118-2122). The text ids come from tokenizing the wrapper's whole assistant turn (W:269)
and slicing, as the reference does, so tokens at the text's edges match it."""

from __future__ import annotations

from dataclasses import dataclass

from server.errors import invalid_request
from server.tokenizer import TextTokenizer
from streaming.qwen3_tts_profile import Qwen3TtsPromptIds

AUTO = "auto"
ROLE_LEN = 3  # <|im_start|> assistant \n
TURN_END_LEN = 5  # <|im_end|> \n <|im_start|> assistant \n


@dataclass(frozen=True)
class Qwen3TtsRows:
    ids: list[int]
    frames: list[list[int]]
    step_text_ids: list[int]


def assistant_turn(text: str) -> str:
    """The wrapper's text for one utterance (W:269): the role, the text, the turn's end and the
    next role (whose ids the prompt builds from the first 3)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_turn(instructions: str) -> str:
    """The wrapper's instruct text (W: _build_instruct_text): a user turn, its ids all text-only
    prompt positions before the role."""
    return f"<|im_start|>user\n{instructions}<|im_end|>\n"


def split_turn(turn_ids: list[int]) -> tuple[list[int], list[int]]:
    """(role ids, text ids) of a tokenized assistant_turn (M: input_id[:, :3] and [:, 3:-5])."""
    if len(turn_ids) < ROLE_LEN + TURN_END_LEN:
        raise ValueError(f"an assistant turn tokenized to {len(turn_ids)} ids: the tokenizer lacks the chat tokens")
    return turn_ids[:ROLE_LEN], turn_ids[ROLE_LEN:-TURN_END_LEN]


def language_id(p: Qwen3TtsPromptIds, speaker: str | None, language: str) -> int | None:
    """The codec id of the prompt's language (None: auto), a dialect speaker's dialect first."""
    language = language.lower()
    if speaker is not None and language in ("chinese", AUTO) and speaker in p.speaker_dialects:
        return p.languages[p.speaker_dialects[speaker]]
    return None if language == AUTO else p.languages[language]


def qwen3_tts_rows(p: Qwen3TtsPromptIds, role_ids: list[int], text_ids: list[int], speaker: str | None,
                   language: str = AUTO, instruct_ids: list[int] = (), non_streaming: bool | None = None) -> Qwen3TtsRows:
    """The prompt rows of `text_ids` (at least one) in `speaker` (a spk_id name, or None: no
    speaker row, VoiceDesign). non_streaming None: the profile's mode."""
    if not text_ids:
        raise ValueError("a Qwen3-TTS prompt needs at least one text id")
    non_streaming = p.non_streaming if non_streaming is None else non_streaming
    k = p.num_code_groups
    ids: list[int] = []
    frames: list[list[int]] = []

    def row(text: int, code: int = -1) -> None:
        ids.append(text)
        frames.append([code] + [-1] * (k - 1))

    for t in [*instruct_ids, *role_ids]:
        row(t)
    lang = language_id(p, speaker, language)
    prefix = [p.nothink, p.think_bos, p.think_eos] if lang is None else [p.think, p.think_bos, lang, p.think_eos]
    if speaker is not None:
        prefix.append(p.speakers[speaker])
    prefix.append(p.codec_pad)
    for i, code in enumerate(prefix):
        row(p.tts_bos if i == len(prefix) - 1 else p.tts_pad, code)
    if non_streaming:
        for t in [*text_ids, p.tts_eos]:
            row(t, p.codec_pad)
        row(p.tts_pad, p.codec_bos)
        return Qwen3TtsRows(ids, frames, [])
    row(text_ids[0], p.codec_bos)
    return Qwen3TtsRows(ids, frames, [*text_ids[1:], p.tts_eos])


class Qwen3TtsPrompts:
    """Text -> rows with the served folder's tokenizer and ids (CustomVoice: voice = speaker;
    VoiceDesign: no speaker, the instructions describe the voice)."""

    def __init__(self, ids: Qwen3TtsPromptIds):
        self.ids = ids

    def build(self, turn_ids: list[int], voice: str, language: str | None = None,
              instruct_ids: list[int] = ()) -> Qwen3TtsRows:
        """Rows of a tokenized assistant_turn; invalid_request naming `input` when the text
        has no ids, `language` when the folder has no such language (None: auto)."""
        role, text = split_turn(turn_ids)
        if not text:
            raise invalid_request("input: the text has no tokens to speak", param="input")
        language = AUTO if language is None else language.lower()
        if language != AUTO and language not in self.ids.languages:
            raise invalid_request(f"language: {language!r} is not one of auto, {', '.join(self.ids.languages)}",
                                  param="language")
        speaker = None if self.ids.designs_voice else voice  # VoiceDesign: no speaker row
        return qwen3_tts_rows(self.ids, role, text, speaker, language, instruct_ids)

    def encode(self, tokenizer: TextTokenizer, voice: str, text: str, language: str | None = None,
               instructions: str | None = None) -> Qwen3TtsRows:
        instruct = tokenizer.encode(instruct_turn(instructions)) if instructions else []
        return self.build(tokenizer.encode(assistant_turn(text)), voice, language, instruct)

    async def encode_async(self, tokenizer: TextTokenizer, voice: str, text: str, language: str | None = None,
                           instructions: str | None = None) -> Qwen3TtsRows:
        instruct = await tokenizer.encode_async(instruct_turn(instructions)) if instructions else []
        return self.build(await tokenizer.encode_async(assistant_turn(text)), voice, language, instruct)
