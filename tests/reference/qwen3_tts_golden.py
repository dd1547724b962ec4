"""Golden files for Qwen3-TTS's talker and code predictor, from the qwen-tts 0.1.1 reference.

Runs only in the reference environment (transformers 4.57.3 + qwen_tts, torchaudio and
onnxruntime stubbed; see tests/reference/build_qwen3_tts_golden.sh), never under pytest.
Usage: python qwen3_tts_golden.py OUT

Two tiny random-weight models (fixed seeds), each saved as a checkpoint folder the way a real
one is laid out (config.json with talker_config.code_predictor_config, model.safetensors,
generation_config.json):
  custom_voice  tts_model_type "custom_voice": code predictor as wide as the talker, so its
                input projection is the Identity (the 0.6B layout); speakers by codec id
  base          tts_model_type "base": a narrower code predictor, so the projection is a
                Linear with bias (the 1.7B layout); a speaker encoder (its tensors are saved)

  ends          custom_voice's layout, another seed, eos's codec_head row scaled so that
                greedy frames end at different frames (and one runs to the limit)

Writes OUT/<model>/:
  checkpoint/       the folder above
  <case>.npz        one `generate()` call per prompt kind, greedy, repetition_penalty 1.0,
                    MAX_NEW_TOKENS steps; the prompt is built by
                    generate's own code, captured by hooking `talker.generate`:
    prompt_embeds [P, H]    talker inputs_embeds of the prompt
    text_ids [P]            the prompt as rows: the text id of each position's text part (-1: none)
    codec_ids [P, G]        ... its codec part: column 0 a talker codec-table id, columns 1.. the
                            groups of a codec frame (-1: none); see layout() below
    xvector [H], xvector_row  (x-vector cases) the speaker vector added at that row
    trailing_ids [Tt]       the text ids fed one per generated step (empty: tts_pad every step)
    prompt_hidden [P, H], prompt_logits [P, V]   the talker at every prompt position (final
                            norm output; codec_head)
    step_hidden [N, H], step_logits [N, V]       the talker at step n's last position (n = 0:
                            the prompt's last; n >= 1: generated frame n - 1 fed back)
    frames [F, G]           generate()'s frames (F = N - 1 when no frame ends the audio: the
                            last step's code 0 is sampled but its groups never are)
  <case>_rep<P>.npz (custom_voice, ends) the same prompt, greedy with code 0's repetition_penalty
                    P / 100 (qwen-tts's default 1.05, and a strong one) over PENALTY_NEW_TOKENS
                    steps: longer, so that generated code-0 ids repeat and the penalty bites
  depth.npz         the code predictor alone: hidden [B, H], frames [B, G] (code 0 given, groups
                    from `code_predictor.generate`, greedy), logits [B, G-1, Vc] teacher-forced
                    (`forward_sub_talker_finetune` over the whole frame)
OUT/manifest.json   the special ids, cases and sizes.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import load_file

from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

G = 4  # code groups (real: 16)
CB = 32  # codes per codebook (real: 2048)
VOCAB = CB + 1024  # talker codec vocabulary: generate() suppresses [VOCAB - 1024, VOCAB) but eos (real 3072)
PAD, BOS, EOS, THINK, NOTHINK, THINK_BOS, THINK_EOS = 40, 41, 42, 43, 44, 45, 46
LANGS = {"english": 50, "chinese": 51, "sichuan": 52}
SPEAKERS = {"alice": 60, "bob": 61}
DIALECT = {"alice": False, "bob": "sichuan"}
TEXT_VOCAB = 200
IM_START, IM_END, TTS_PAD, TTS_BOS, TTS_EOS = 150, 151, 152, 153, 154
ASSISTANT, NEWLINE = 155, 156
MAX_NEW_TOKENS = 9
# greedy with code 0's repetition penalty (generate's input_ids start empty: only generated
# code-0 ids count); run after every other output, so those stay byte-identical
PENALTIES = (1.05, 1.5)
PENALTY_NEW_TOKENS = 24
ROLE = [IM_START, ASSISTANT, NEWLINE]
MODELS = {
    "custom_voice": dict(kind="custom_voice", seed=11, predictor_hidden=64),
    "base": dict(kind="base", seed=12, predictor_hidden=32),
    # custom_voice's prompts with eos's codec_head row scaled: greedy frames end after 3 and 5
    # frames and at frame 2 (the first where min_new_tokens=2 lets eos through); one runs on
    "ends": dict(kind="custom_voice", seed=14, predictor_hidden=64, eos_scale=3.0),
}


def config(kind: str, predictor_hidden: int) -> Qwen3TTSConfig:
    base = kind == "base"
    return Qwen3TTSConfig(
        tts_model_type=kind, tts_model_size="tiny", tokenizer_type="qwen3_tts_tokenizer_12hz",
        im_start_token_id=IM_START, im_end_token_id=IM_END, tts_pad_token_id=TTS_PAD, tts_bos_token_id=TTS_BOS,
        tts_eos_token_id=TTS_EOS,
        talker_config=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
            # MRoPE over 3 identical position streams (what the talker always gets) = plain RoPE
            rope_scaling={"mrope_section": [4, 2, 2], "interleaved": True, "rope_type": "default"},
            num_code_groups=G, text_vocab_size=TEXT_VOCAB, text_hidden_size=48,
            codec_eos_token_id=EOS, codec_think_id=THINK, codec_nothink_id=NOTHINK, codec_think_bos_id=THINK_BOS,
            codec_think_eos_id=THINK_EOS, codec_pad_id=PAD, codec_bos_id=BOS,
            spk_id={} if base else SPEAKERS, spk_is_dialect={} if base else DIALECT, codec_language_id=LANGS,
            code_predictor_config=dict(vocab_size=CB, hidden_size=predictor_hidden, intermediate_size=80,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=8, max_position_embeddings=64, rope_theta=10000.0,
                                       num_code_groups=G)),
        speaker_encoder_config=dict(enc_dim=64, enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16,
                                    enc_res2net_scale=4, enc_se_channels=16))


@torch.no_grad()
def randomise(model: Qwen3TTSForConditionalGeneration) -> None:
    """Unit-scale activations and non-neutral norms (the 0.02 init gives near-uniform logits, so
    greedy frames would repeat one code and test nothing)."""
    for name, p in model.talker.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape))
        elif p.dim() == 1:  # biases
            p.copy_(0.3 * torch.randn(p.shape))
        elif "embedding" in name:
            p.copy_(torch.randn(p.shape))
        else:
            p.copy_(torch.randn(p.shape) * 2.0 * p.shape[1] ** -0.5)


def save(model: Qwen3TTSForConditionalGeneration, folder: str) -> None:
    model.save_pretrained(folder)
    # Qwen3TTSSpeakerEncoderConfig takes no **kwargs but to_dict() writes model_type: drop it so
    # the folder loads back (a reference-package bug, docs/qwen3_tts.md §4)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw["speaker_encoder_config"].pop("model_type", None)
    with open(path, "w") as f:
        json.dump(raw, f, indent=2)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:  # the released folders' keys
        json.dump({"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
                   "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
                   "subtalker_temperature": 0.9, "max_new_tokens": 8192}, f, indent=2)


def input_ids(text: list[int]) -> torch.Tensor:
    """The wrapper's assistant text (W:269): role, text, <|im_end|>\\n, role."""
    return torch.tensor([ROLE + text + [IM_END, NEWLINE] + ROLE])


def layout(case: dict, cfg: Qwen3TTSConfig) -> tuple[list[int], list[list[int]], list[int], int]:
    """The prompt as rows (text id or -1, codec ids [G] or -1s), the trailing text ids and the
    x-vector's row (-1: none), per M:2022-2234. Checked below against generate's own embeddings."""
    none = [-1] * G
    text_ids, codec = [], []

    def row(text: int, code: int | list[int] | None) -> None:
        text_ids.append(text)
        codec.append(none if code is None else (code if isinstance(code, list) else [code] + [-1] * (G - 1)))

    for t in case.get("instruct", []):
        row(t, None)
    for t in ROLE:
        row(t, None)
    lang, speaker = case["language"], case.get("speaker")
    lang_id = None if lang == "auto" else LANGS[lang]
    if speaker and lang in ("chinese", "auto") and DIALECT[speaker]:
        lang_id = LANGS[DIALECT[speaker]]
    prefix = [NOTHINK, THINK_BOS, THINK_EOS] if lang_id is None else [THINK, THINK_BOS, lang_id, THINK_EOS]
    xvector_row = -1
    if speaker:
        prefix.append(SPEAKERS[speaker])
    elif "xvector" in case:
        prefix.append(None)  # the x-vector takes the codec part
    prefix.append(PAD)
    for i, code in enumerate(prefix):
        if code is None:
            xvector_row = len(text_ids)
        row(TTS_BOS if i == len(prefix) - 1 else TTS_PAD, code)
    text = case["text"]
    if "ref_codes" in case:  # ICL: [ref text, text, tts_eos] over [bos, ref frames]
        texts = case["ref_text"] + text + [TTS_EOS]
        codes = [[BOS] + [-1] * (G - 1)] + case["ref_codes"]
        if case["non_streaming"]:
            for t in texts:
                row(t, PAD)
            for c in codes:
                row(TTS_PAD, c)
            return text_ids, codec, [], xvector_row
        n = len(codes)
        for t, c in zip(texts + [TTS_PAD] * max(0, n - len(texts)), codes):
            row(t, c)
        return text_ids, codec, texts[n:], xvector_row
    if case["non_streaming"]:
        for t in text + [TTS_EOS]:
            row(t, PAD)
        row(TTS_PAD, BOS)
        return text_ids, codec, [], xvector_row
    row(text[0], BOS)
    return text_ids, codec, text[1:] + [TTS_EOS], xvector_row


def cases(kind: str, gen: torch.Generator) -> dict[str, dict]:
    def text(n: int) -> list[int]:
        return torch.randint(0, 140, (n,), generator=gen).tolist()

    if kind == "custom_voice":
        return {
            "speaker_streaming": dict(text=text(6), language="english", speaker="alice", non_streaming=False),
            "speaker_non_streaming": dict(text=text(4), language="auto", speaker="alice", non_streaming=True),
            "dialect_streaming": dict(text=text(9), language="auto", speaker="bob", non_streaming=False),
            "instruct_no_speaker": dict(text=text(5), language="chinese", instruct=[IM_START] + text(4),
                                        non_streaming=True),
        }
    ref_codes = torch.randint(0, CB, (3, G), generator=gen).tolist()
    return {
        "xvector": dict(text=text(7), language="english", xvector=True, non_streaming=False),
        "icl_streaming": dict(text=text(6), language="auto", xvector=True, ref_text=text(2), ref_codes=ref_codes,
                              non_streaming=False),
        "icl_non_streaming": dict(text=text(3), language="english", xvector=True, ref_text=text(2),
                                  ref_codes=ref_codes, non_streaming=True),
    }


@torch.no_grad()
def run_case(model: Qwen3TTSForConditionalGeneration, case: dict, gen: torch.Generator | None,
             repetition_penalty: float = 1.0, max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, np.ndarray]:
    talker = model.talker
    hidden = talker.config.hidden_size
    captured: dict = {}
    original = talker.generate

    def hooked(**kw):  # generate's own prompt, and the raw logits of every step
        captured.update(kw)
        out = original(**kw, output_logits=True)
        captured["result"] = out
        return out

    talker.generate = hooked
    kw: dict = dict(input_ids=[input_ids(case["text"])], languages=[case["language"]],
                    non_streaming_mode=case["non_streaming"], max_new_tokens=max_new_tokens, do_sample=False,
                    subtalker_dosample=False, repetition_penalty=repetition_penalty)
    xvector = None
    if "instruct" in case:
        kw["instruct_ids"] = [torch.tensor([case["instruct"]])]
    if case.get("speaker"):
        kw["speakers"] = [case["speaker"]]
    if case.get("xvector"):
        xvector = torch.randn(hidden, generator=gen)
        icl = "ref_codes" in case
        kw["voice_clone_prompt"] = dict(ref_code=[torch.tensor(case["ref_codes"])] if icl else None,
                                        ref_spk_embedding=[xvector], x_vector_only_mode=[not icl], icl_mode=[icl])
        if icl:
            kw["ref_ids"] = [torch.tensor([ROLE + case["ref_text"] + [IM_END, NEWLINE]])]
    try:
        codes, _ = model.generate(**kw)
    finally:
        del talker.generate
    res = captured["result"]
    prompt = captured["inputs_embeds"][0]  # [P, H]
    text_ids, codec, trailing, xrow = layout(case, model.config)
    # the layout must rebuild generate's prompt: text part + codec part (+ the x-vector)
    ours = embed_rows(talker, torch.tensor(text_ids), torch.tensor(codec))
    if xrow >= 0:
        ours[xrow] += xvector
    assert torch.allclose(ours, prompt, atol=1e-5), (case, (ours - prompt).abs().max())
    trailing_ref = captured["trailing_text_hidden"][0]
    if trailing:
        assert torch.allclose(embed_rows(talker, torch.tensor(trailing), torch.full((len(trailing), G), -1)),
                              trailing_ref, atol=1e-5)
    steps = res.hidden_states  # per step: ((layer hiddens..., final norm), codec_ids)
    prompt_hidden = steps[0][0][-1][0]
    out = dict(
        prompt_embeds=prompt, text_ids=torch.tensor(text_ids), codec_ids=torch.tensor(codec),
        trailing_ids=torch.tensor(trailing, dtype=torch.int64),
        prompt_hidden=prompt_hidden, prompt_logits=talker.codec_head(prompt_hidden),
        step_hidden=torch.stack([s[0][-1][0, -1] for s in steps]),
        step_logits=torch.stack([lg[0] for lg in res.logits]),
        frames=codes[0],
    )
    if xvector is not None:
        out.update(xvector=xvector, xvector_row=torch.tensor(xrow))
    return {k: v.numpy() for k, v in out.items()}


def embed_rows(talker, text_ids: torch.Tensor, codec: torch.Tensor) -> torch.Tensor:
    """text_projection(text_embedding(id)) where id >= 0, plus codec_embedding(codec[:, 0]) and
    the predictor's table g - 1 for codec[:, g] (g >= 1) where >= 0."""
    out = torch.where((text_ids >= 0)[:, None],
                      talker.text_projection(talker.get_text_embeddings()(text_ids.clamp(min=0))), 0.0)
    tables = [talker.get_input_embeddings()] + list(talker.code_predictor.get_input_embeddings())
    for g in range(G):
        out = out + torch.where((codec[:, g] >= 0)[:, None], tables[g](codec[:, g].clamp(min=0)), 0.0)
    return out


@torch.no_grad()
def depth_golden(model: Qwen3TTSForConditionalGeneration, gen: torch.Generator) -> dict[str, np.ndarray]:
    talker = model.talker
    b = 5
    hidden = torch.randn(b, talker.config.hidden_size, generator=gen) * 3
    code0 = torch.randint(0, CB, (b, 1), generator=gen)
    frames = []
    for r in range(b):  # alone: generate has no masks for its inputs_embeds rows
        pred = talker.code_predictor.generate(
            inputs_embeds=torch.cat((hidden[r : r + 1, None], talker.get_input_embeddings()(code0[r : r + 1])), 1),
            max_new_tokens=G - 1, do_sample=False)
        frames.append(torch.cat((code0[r], pred[0])))
    frames = torch.stack(frames)
    logits, _ = talker.forward_sub_talker_finetune(frames, hidden)
    return dict(hidden=hidden.numpy(), frames=frames.numpy(), logits=logits.numpy())


def penalty_cases(model: Qwen3TTSForConditionalGeneration, folder: str, specs: dict[str, dict]) -> list[str]:
    """Every prompt of `specs` greedy under each of PENALTIES: OUT/<model>/<case>_rep<P>.npz. Asserts
    that the penalty changes some frames (else these files would test nothing)."""
    names, differ = [], 0
    for name, case in specs.items():
        plain = run_case(model, case, None, 1.0, PENALTY_NEW_TOKENS)["frames"]
        for p in PENALTIES:
            arrays = run_case(model, case, None, p, PENALTY_NEW_TOKENS)
            stem = f"{name}_rep{round(p * 100)}"
            np.savez(os.path.join(folder, f"{stem}.npz"), **arrays)
            names.append(stem)
            same = arrays["frames"].shape == plain.shape and bool((arrays["frames"] == plain).all())
            differ += not same
            print(f"{stem}: frames {arrays['frames'].shape[0]}, {'same as' if same else 'differ from'} penalty 1.0")
    assert differ, "no penalty changed a greedy frame: the penalty cases would prove nothing"
    return names


def main(out: str) -> None:
    assert transformers.__version__ == "4.57.3", f"reference transformers 4.57.3, got {transformers.__version__}"
    torch.set_num_threads(1)
    manifest: dict = dict(groups=G, codebook_size=CB, vocab=VOCAB, max_new_tokens=MAX_NEW_TOKENS,
                          ids=dict(pad=PAD, bos=BOS, eos=EOS, tts_pad=TTS_PAD, tts_bos=TTS_BOS, tts_eos=TTS_EOS),
                          models={}, penalties=list(PENALTIES), penalty_new_tokens=PENALTY_NEW_TOKENS,
                          penalty_cases={})
    for label, spec in MODELS.items():
        kind = spec["kind"]
        torch.manual_seed(spec["seed"])
        model = Qwen3TTSForConditionalGeneration(config(kind, spec["predictor_hidden"])).eval()
        randomise(model)
        with torch.no_grad():
            model.talker.codec_head.weight[EOS] *= spec.get("eos_scale", 1.0)
        folder = os.path.join(out, label)
        ckpt = os.path.join(folder, "checkpoint")
        save(model, ckpt)
        # the folder holds exactly the weights run below (from_pretrained would also want a
        # speech_tokenizer/, the codec golden's business)
        saved = load_file(os.path.join(ckpt, "model.safetensors"))
        assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items()), "save_pretrained changed a tensor"
        gen = torch.Generator().manual_seed(spec["seed"])
        names = []
        for name, case in cases(kind, gen).items():
            arrays = run_case(model, case, gen)
            np.savez(os.path.join(folder, f"{name}.npz"), **arrays)
            names.append(name)
            print(f"{label}/{name}: prompt {len(arrays['text_ids'])}, trailing {len(arrays['trailing_ids'])}, "
                  f"frames {arrays['frames'].shape[0]}")
        np.savez(os.path.join(folder, "depth.npz"), **depth_golden(model, gen))
        manifest["models"][label] = names
        if kind == "custom_voice":  # no x-vector: the engine runs these prompts
            manifest["penalty_cases"][label] = penalty_cases(model, folder, cases(kind, torch.Generator().manual_seed(spec["seed"])))
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT")
    main(sys.argv[1])
