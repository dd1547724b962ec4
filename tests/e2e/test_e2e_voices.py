"""Reference voices on a real server with a tiny CSM: upload a clip (any rate, channels and
format FFmpeg reads), list it, speak in it through the OpenAI client, the second request in the
voice served from the prefix cache, the voice kept across a restart, deleted; bad uploads
answered naming the field."""

from __future__ import annotations

import io
import json
import wave

import aiohttp
import av
import numpy as np
import openai
import pytest
import websockets

from tests.support.server_proc import ServerProc, start_server
from tests.support.tiny_models import make_served_csm

pytestmark = pytest.mark.e2e

MIMI_FRAME_BYTES = 1920 * 2


def wav_clip(seconds: float, rate: int = 44100, channels: int = 2) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    x = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(x[:, None], channels, axis=1).tobytes())
    return buf.getvalue()


def flac_clip(seconds: float) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as out:
        stream = out.add_stream("flac", rate=16000, layout="mono")
        t = np.arange(int(seconds * 16000)) / 16000
        frame = av.AudioFrame.from_ndarray((0.2 * np.sin(2 * np.pi * 330 * t) * 32767).astype(np.int16)[None], format="s16",
                                           layout="mono")
        frame.sample_rate = 16000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def csm_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("voices")
    return root, make_served_csm(root / "csm", seed=2, max_frames=12)


def start(root, folder) -> ServerProc:
    return start_server(root / "srv", "--model", str(folder), "--voices-dir", str(root / "voices"), "--max-voices", "2",
                        "--max-voice-upload-bytes", "400000", "--max-voice-seconds", "4")


async def upload(http: aiohttp.ClientSession, srv: ServerProc, name: str | None, clip: bytes | None,
                 transcript: str | None = "Hello there.", **extra: str) -> tuple[int, dict]:
    form = aiohttp.FormData(default_to_multipart=True)
    for key, value in (("name", name), ("transcript", transcript), *extra.items()):
        if value is not None:
            form.add_field(key, value)
    if clip is not None:
        form.add_field("file", clip, filename="clip", content_type="application/octet-stream")
    async with http.post(srv.base_url + "/v1/audio/voices", data=form) as r:
        return r.status, await r.json(content_type=None)


async def hits(http: aiohttp.ClientSession, srv: ServerProc) -> int:
    async with http.get(srv.base_url + "/v1/engine/stats") as r:
        return (await r.json())["num_prefix_cache_hit_tokens"]


def speak(srv: ServerProc, voice: str, text: str, seed: int = 1) -> bytes:
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")
    with client.audio.speech.with_streaming_response.create(model="omnistream", voice=voice, input=text,
                                                            response_format="pcm", extra_body={"seed": seed}) as r:
        assert r.status_code == 200, r.text
        return b"".join(r.iter_bytes())


async def test_upload_speak_cache_restart_delete(csm_root):
    root, folder = csm_root
    srv = start(root, folder)
    try:
        async with aiohttp.ClientSession() as http:
            status, body = await upload(http, srv, "narrator", wav_clip(1.0), speaker="1")
            assert status == 201, body
            assert body["frames"] == 13 and body["speaker"] == "1" and abs(body["duration_s"] - 1.0) < 1e-3
            status, body = await upload(http, srv, "flac-voice", flac_clip(0.5))
            assert status == 201 and body["frames"] == 7, body
            async with http.get(srv.base_url + "/v1/audio/voices") as r:
                listed = {v["voice_id"]: v for v in (await r.json())["voices"]}
            assert set(listed) == {"0", "1", "narrator", "flac-voice"} and listed["narrator"]["type"] == "reference"
            before = await hits(http, srv)
            a = speak(srv, "narrator", "How are you today?")
            cold = await hits(http, srv) - before
            b = speak(srv, "narrator", "The weather is fine.")
            warm = await hits(http, srv) - before - cold
            assert a and b and len(a) % MIMI_FRAME_BYTES == 0 and len(b) % MIMI_FRAME_BYTES == 0
            # the shared voice prefix (transcript turn, 13 frame positions, audio end: >= 16 positions)
            # is computed once: the second request's whole blocks of it come from the cache
            assert warm >= 16 and warm > cold
            assert speak(srv, "narrator", "How are you today?") == a  # same voice, text, seed: same audio
            # bounds: name taken, too many voices, too large, too long, not audio, fields missing
            assert (await upload(http, srv, "narrator", wav_clip(0.5)))[0] == 409
            assert (await upload(http, srv, "third", wav_clip(0.5)))[0] == 409
            status, body = await upload(http, srv, "x", b"\0" * 500_000)
            assert status == 413 and body["error"]["param"] == "file"
            async with http.delete(srv.base_url + "/v1/audio/voices/flac-voice") as r:
                assert r.status == 204
            for bad, param in ((dict(name="long", clip=wav_clip(5.0, rate=8000, channels=1)), "file"),
                               (dict(name="junk", clip=b"not audio at all" * 100), "file"),
                               (dict(name="no-text", clip=wav_clip(0.5), transcript=None), "transcript"),
                               (dict(name="ctl", clip=wav_clip(0.5), transcript="hi\x00there"), "transcript"),
                               (dict(name="bad name!", clip=wav_clip(0.5)), "name"),
                               (dict(name="nofile", clip=None), "file")):
                status, body = await upload(http, srv, **bad)
                assert status == 400 and body["error"]["param"] == param, (bad["name"], status, body)
                assert "Errno" not in body["error"]["message"] and "<none>" not in body["error"]["message"]
        srv.stop()
        srv = start(root, folder)  # the voice outlives the process
        async with aiohttp.ClientSession() as http:
            assert speak(srv, "narrator", "How are you today?") == a
            async with http.delete(srv.base_url + "/v1/audio/voices/narrator") as r:
                assert r.status == 204
            for name in ("narrator", "0"):
                async with http.delete(srv.base_url + f"/v1/audio/voices/{name}") as r:
                    assert r.status == 404 and (await r.json())["error"]["param"] == "voice_id"
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.speech.create(model="omnistream", voice="narrator", input="hi", response_format="pcm")
        assert e.value.body["param"] == "voice"
    finally:
        srv.stop()


async def post_raw(http: aiohttp.ClientSession, srv: ServerProc, content_type: str, body: bytes) -> tuple[int, dict]:
    async with http.post(srv.base_url + "/v1/audio/voices", data=body, headers={"Content-Type": content_type}) as r:
        return r.status, await r.json(content_type=None)


async def test_malformed_uploads_and_a_hand_edited_voices_folder(csm_root):
    """A broken multipart body is a 400 naming the body (it was a 500); a voices folder edited
    by hand loads under the upload rules: no built-in name, no invalid name, at most --max-voices."""
    root, folder = csm_root
    root = root / "edited"
    srv = start(root, folder)
    try:
        async with aiohttp.ClientSession() as http:
            status, body = await upload(http, srv, "good", wav_clip(0.5))
            assert status == 201, body
            part = b'--XX\r\nContent-Disposition: form-data; name="name"\r\n\r\n'
            nested = (b'--XX\r\nContent-Type: multipart/mixed; boundary=YY\r\n\r\n--YY\r\n'
                      b'Content-Disposition: form-data; name="name"\r\n\r\nv\r\n--YY--\r\n--XX--\r\n')
            for ctype, raw in (("multipart/form-data", b"x"),  # no boundary
                               ("multipart/form-data; boundary=XX", b"no boundary in here"),
                               ("multipart/form-data; boundary=XX", part + b"abc"),  # truncated
                               ("multipart/form-data; boundary=XX", nested)):
                status, body = await post_raw(http, srv, ctype, raw)
                assert status == 400 and body["error"]["param"] == "body", (raw, status, body)
            async with http.get(srv.base_url + "/v1/audio/voices") as r:
                assert r.status == 200 and "good" in {v["voice_id"] for v in (await r.json())["voices"]}
            # a session's voice deleted mid-session: its next sentence is refused naming the voice
            # (it was spoken as a made-up speaker of that name)
            assert (await upload(http, srv, "temp", wav_clip(0.5)))[0] == 201
            async with websockets.connect(srv.ws_url + "/v1/audio/speech/stream") as ws:
                await ws.recv()  # session.created
                await ws.send(json.dumps({"type": "session.config", "voice": "temp", "max_new_tokens": 3}))
                await ws.send(json.dumps({"type": "input.text", "text": "First sentence."}))
                await ws.send(json.dumps({"type": "input.flush"}))
                while not isinstance(m := await ws.recv(), str) or json.loads(m)["type"] != "audio.done":
                    pass  # the first sentence's audio, spoken in the voice
                async with http.delete(srv.base_url + "/v1/audio/voices/temp") as r:
                    assert r.status == 204
                await ws.send(json.dumps({"type": "input.text", "text": "Second sentence."}))
                await ws.send(json.dumps({"type": "session.close"}))
                events = [json.loads(m) async for m in ws if isinstance(m, str)]
            errors = [e for e in events if e["type"] == "error"]
            assert errors and errors[0]["param"] == "voice" and "temp" in errors[0]["message"], events
        srv.stop()
        voices = root / "voices"
        meta, codes = json.loads((voices / "good.json").read_text()), (voices / "good.npy").read_bytes()
        for name in ("0", "x y", "extra1", "extra2"):  # a built-in name, a bad name, two more than the limit allows
            (voices / f"{name}.json").write_text(json.dumps({**meta, "name": name}))
            (voices / f"{name}.npy").write_bytes(codes)
        srv = start(root, folder)
        async with aiohttp.ClientSession() as http:
            async with http.get(srv.base_url + "/v1/audio/voices") as r:
                voices_listed = (await r.json())["voices"]
        listed = [v["voice_id"] for v in voices_listed]
        reference = {v["voice_id"] for v in voices_listed if v["type"] == "reference"}
        assert listed.count("0") == 1 and "x y" not in listed and "0" not in reference
        assert len(reference) == 2 and reference <= {"good", "extra1", "extra2"}  # --max-voices 2
        log = srv.output(100_000)
        assert "not a name an upload may take" in log and "--max-voices 2 reached" in log
    finally:
        srv.stop()
