"""Qwen3-TTS prompts (docs/qwen3_tts.md §1, M:2022-2234): every position's input is a text part
plus a codec part, so a prompt is rows, not a text: `ids` [P] the text id of each position,
`frames` [P][K] its codec part (column 0 a talker codec-table id, -1 where the position reads
none; all K codes on a reference clip's frame), `step_text_ids` the trailing text fed one id a
generated frame (streaming text mode; [] non-streaming), `vector_row` the position whose codec
part is a voice's x-vector (Base; the engine adds it, ipc.PromptVector) or None.

Layout, role = `<|im_start|>assistant\\n` (3 ids), T0..Tm-1 the text's ids:
    [instruct ids: text only]  role: text only
    prefix: text tts_pad x (n-1), tts_bos over codec [nothink, think_bos, think_eos] (language
            auto) or [think, think_bos, lang, think_eos], then the speaker, then codec_pad
    non-streaming: T_i over codec_pad, tts_eos over codec_pad, tts_pad over codec_bos
    streaming:     T0 over codec_bos; trailing [T1..Tm-1, tts_eos]
A dialect speaker's dialect replaces the language when the language is chinese or auto
(M:2118-2122). A cloned voice (Base, M:1968-2020) puts its x-vector where the speaker goes and,
in ICL mode (a clip with its transcript R0..Rr-1 and frames F0..Ff-1), replaces the text rows:
    ICL non-streaming: [R.., T.., tts_eos] over codec_pad, then tts_pad over [codec_bos, F..]
    ICL streaming:     [R.., T.., tts_eos, tts_pad..] over [codec_bos, F..] pairwise (text
                       padded with tts_pad to the codec's length); trailing: the text left over The text ids come from tokenizing the wrapper's whole assistant turn (W:269)
and slicing, as the reference does, so tokens at the text's edges match it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from server.errors import invalid_request
from server.tokenizer import TextTokenizer
from streaming.qwen3_tts_profile import Qwen3TtsPromptIds

log = logging.getLogger(__name__)

AUTO = "auto"
ROLE_LEN = 3  # <|im_start|> assistant \n
TURN_END_LEN = 5  # <|im_end|> \n <|im_start|> assistant \n


@dataclass(frozen=True)
class Qwen3TtsRows:
    ids: list[int]
    frames: list[list[int]]
    step_text_ids: list[int]
    vector_row: int | None = None


@dataclass(frozen=True)
class CloneRef:
    """A Base voice: the x-vector goes over the speaker row; with `text_ids` (the clip's
    transcript, ref_turn's [3:-2]) and `frames` [F][K] (its codes) the prompt is ICL."""

    text_ids: list[int] = ()
    frames: list[list[int]] = ()

    @property
    def icl(self) -> bool:
        return bool(self.text_ids) and bool(self.frames)


def assistant_turn(text: str) -> str:
    """The wrapper's text for one utterance (W:269): the role, the text, the turn's end and the
    next role (whose ids the prompt builds from the first 3)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def ref_turn(transcript: str) -> str:
    """The wrapper's reference text (W:272): its ids [3:-2] are the ICL prompt's reference text."""
    return f"<|im_start|>assistant\n{transcript}<|im_end|>\n"


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
                   language: str = AUTO, instruct_ids: list[int] = (), non_streaming: bool | None = None,
                   clone: CloneRef | None = None) -> Qwen3TtsRows:
    """The prompt rows of `text_ids` (at least one) in `speaker` (a spk_id name, or None: no
    speaker row, VoiceDesign) or, with `clone`, in a cloned voice (speaker None).
    non_streaming None: the profile's mode."""
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
    vector_row = None
    if speaker is not None:
        prefix.append(p.speakers[speaker])
    elif clone is not None:
        vector_row = len(ids) + len(prefix)
        prefix.append(-1)  # no table: the x-vector is the codec part
    prefix.append(p.codec_pad)
    for i, code in enumerate(prefix):
        row(p.tts_bos if i == len(prefix) - 1 else p.tts_pad, code)
    if clone is not None and clone.icl:
        texts = [*clone.text_ids, *text_ids, p.tts_eos]
        codes = [[p.codec_bos] + [-1] * (k - 1), *(list(f) for f in clone.frames)]
        if non_streaming:
            for t in texts:
                row(t, p.codec_pad)
            for c in codes:
                ids.append(p.tts_pad)
                frames.append(c)
            return Qwen3TtsRows(ids, frames, [], vector_row)
        for t, c in zip(texts + [p.tts_pad] * max(0, len(codes) - len(texts)), codes):
            ids.append(t)
            frames.append(c)
        return Qwen3TtsRows(ids, frames, texts[len(codes):], vector_row)
    if non_streaming:
        for t in [*text_ids, p.tts_eos]:
            row(t, p.codec_pad)
        row(p.tts_pad, p.codec_bos)
        return Qwen3TtsRows(ids, frames, [], vector_row)
    row(text_ids[0], p.codec_bos)
    return Qwen3TtsRows(ids, frames, [*text_ids[1:], p.tts_eos], vector_row)


class Qwen3TtsPrompts:
    """Text -> rows with the served folder's tokenizer and ids (CustomVoice: voice = speaker;
    VoiceDesign: no speaker, the instructions describe the voice; Base: a cloned voice, its
    transcript and codes given per request as `clone`: (transcript, frames), transcript "" for
    the x-vector alone)."""

    def __init__(self, ids: Qwen3TtsPromptIds):
        self.ids = ids

    def build(self, turn_ids: list[int], voice: str, language: str | None = None,
              instruct_ids: list[int] = (), clone: CloneRef | None = None) -> Qwen3TtsRows:
        """Rows of a tokenized assistant_turn; invalid_request naming `input` when the text
        has no ids, `language` when the folder has no such language (None: auto)."""
        role, text = split_turn(turn_ids)
        if not text:
            raise invalid_request("input: the text has no tokens to speak", param="input")
        return self._rows(role, text, voice, language, instruct_ids, clone, None)

    def build_open(self, role: list[int], text: list[int], voice: str, language: str | None = None,
                   instruct_ids: list[int] = (), clone: CloneRef | None = None) -> Qwen3TtsRows | None:
        """The streaming-text rows of a text still arriving, `text` its final ids so far:
        step_text_ids are the ids past the prompt's, without the closing tts_eos (the rest of
        the text comes as it arrives). None while the ids so far do not fix the prompt's rows
        (none yet; an ICL voice pairs text with its clip's frames, so it needs as many ids as
        frames, less its transcript's)."""
        if not text:
            return None
        rows = self._rows(role, text, voice, language, instruct_ids, clone, False)
        if rows.step_text_ids[-1:] != [self.ids.tts_eos]:
            return None
        return Qwen3TtsRows(rows.ids, rows.frames, rows.step_text_ids[:-1], rows.vector_row)

    def _rows(self, role: list[int], text: list[int], voice: str, language: str | None, instruct_ids: list[int],
              clone: CloneRef | None, non_streaming: bool | None) -> Qwen3TtsRows:
        language = AUTO if language is None else language.lower()
        if language != AUTO and language not in self.ids.languages:
            raise invalid_request(f"language: {language!r} is not one of auto, {', '.join(self.ids.languages)}",
                                  param="language")
        # VoiceDesign and cloned voices: no speaker row (a clone's x-vector takes its place)
        speaker = None if self.ids.designs_voice or clone is not None else voice
        return qwen3_tts_rows(self.ids, role, text, speaker, language, instruct_ids, non_streaming, clone=clone)

    @staticmethod
    def _clone(ref_ids: list[int] | None, frames: list[list[int]]) -> CloneRef:
        # the wrapper's ref_ids[:, 3:-2]: the transcript between the role and <|im_end|>\n
        return CloneRef(ref_ids[ROLE_LEN:-2], frames) if ref_ids else CloneRef()

    def encode(self, tokenizer: TextTokenizer, voice: str, text: str, language: str | None = None,
               instructions: str | None = None, clone: tuple[str, list[list[int]]] | None = None) -> Qwen3TtsRows:
        instruct = tokenizer.encode(instruct_turn(instructions)) if instructions else []
        ref = (self._clone(tokenizer.encode(ref_turn(clone[0])) if clone[0] else None, clone[1])
               if clone is not None else None)
        return self.build(tokenizer.encode(assistant_turn(text)), voice, language, instruct, ref)

    async def _context_async(self, tokenizer: TextTokenizer, instructions: str | None,
                             clone: tuple[str, list[list[int]]] | None) -> tuple[list[int], CloneRef | None]:
        """What precedes the text, tokenized off the event loop: the instruct turn's ids and a
        cloned voice's CloneRef (its transcript's ids)."""
        instruct = await tokenizer.encode_async(instruct_turn(instructions)) if instructions else []
        if clone is None:
            return instruct, None
        return instruct, self._clone(await tokenizer.encode_async(ref_turn(clone[0])) if clone[0] else None, clone[1])

    async def encode_open(self, tokenizer: TextTokenizer, voice: str, text_ids: list[int], language: str | None = None,
                          instructions: str | None = None,
                          clone: tuple[str, list[list[int]]] | None = None) -> Qwen3TtsRows | None:
        """build_open over a tokenizer: `text_ids` the final ids so far (StreamedText)."""
        instruct, ref = await self._context_async(tokenizer, instructions, clone)
        role, _ = split_turn(await tokenizer.encode_async(assistant_turn("")))
        return self.build_open(role, text_ids, voice, language, instruct, ref)

    async def encode_async(self, tokenizer: TextTokenizer, voice: str, text: str, language: str | None = None,
                           instructions: str | None = None,
                           clone: tuple[str, list[list[int]]] | None = None) -> Qwen3TtsRows:
        instruct, ref = await self._context_async(tokenizer, instructions, clone)
        return self.build(await tokenizer.encode_async(assistant_turn(text)), voice, language, instruct, ref)


class StreamedText:
    """A text arriving in pieces (a client streaming an LLM's output into speech) -> the text
    ids of a Qwen3-TTS prompt as they become final: those of the text up to where its last
    pre-tokenized word starts (TextTokenizer.settled: at each space in English, at each
    punctuation mark in Chinese), which do not change with what follows. Each call
    re-tokenizes the settled text as the wrapper's assistant turn and slices it, as a whole
    text would be."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self.sent: list[int] = []  # ids handed out so far

    async def feed(self, piece: str, final: bool) -> list[int]:
        """Add `piece`; -> the ids that became final (all the rest when `final`)."""
        self.text += piece
        text = self.text if final else self.tokenizer.settled(self.text)
        if not text:
            return []
        _, ids = split_turn(await self.tokenizer.encode_async(assistant_turn(text)))
        n = len(self.sent)
        if ids[:n] != self.sent:  # a boundary the rule above missed: the ids already fed stay
            log.warning("streamed text: ids of %r changed under more text; keeping the %d already fed", self.text, n)
        new = ids[n:]
        self.sent += new
        return new
