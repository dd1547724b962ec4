"""Voice-agent clients against the real server, changing only their base URL: LiveKit's ElevenLabs
plugin (livekit-plugins-elevenlabs 1.8.9: multi-stream-input and the HTTP /stream path), the
official `elevenlabs` SDK (convert_realtime over stream-input, which always connects with TLS:
a local TLS proxy with a throwaway self-signed certificate sits in front), and the `cartesia`
SDK (tts/websocket, in test_e2e_cartesia.py). Each test skips, saying so, when its client
package is not installed (they are not in the test extras: livekit-agents brings a large tree).

Pipecat's services need a running pipeline; tests/server/test_server_elevenlabs_ws.py and
test_server_elevenlabs_http.py replay their exact messages instead.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import threading
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from tests.e2e.helpers import SAMPLE_RATE

pytestmark = pytest.mark.e2e


async def test_livekit_elevenlabs_plugin_streams_audio_and_timed_words(server):
    elevenlabs = pytest.importorskip("livekit.plugins.elevenlabs", reason="livekit-plugins-elevenlabs not installed")
    from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

    text = "Hello there. How are you today?"
    async with aiohttp.ClientSession() as http:
        tts = elevenlabs.TTS(base_url=server.base_url + "/v1", api_key="unused", voice_id="tara",
                             encoding="pcm_24000", http_session=http)
        try:
            stream = tts.stream()
            stream.push_text(text + " ")
            stream.end_input()
            samples, words = 0, []
            async for ev in stream:
                assert ev.frame.sample_rate == SAMPLE_RATE
                samples += ev.frame.samples_per_channel
                words += ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])
            await stream.aclose()
            assert samples > 0
            assert "".join(str(w) for w in words).split() == text.split()
            starts = [w.start_time for w in words]
            assert starts == sorted(starts) and all(w.end_time >= w.start_time for w in words)
            assert words[-1].end_time == pytest.approx(samples / SAMPLE_RATE, abs=0.01)

            chunked = 0  # the plugin's non-streaming path: POST {base}/text-to-speech/{voice}/stream
            async for ev in tts.synthesize("Hi."):
                chunked += ev.frame.samples_per_channel
            assert chunked > 0
        finally:
            await tts.aclose()


# ---- the elevenlabs SDK, through a local TLS proxy ----------------------------------------------


def self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


class TlsProxy:
    """TLS on a free loopback port, forwarding bytes to the server's plain port (in a thread)."""

    def __init__(self, cert: Path, key: Path, target_port: int):
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(cert, key)
        self._target = target_port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        srv = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0, ssl=self._ctx))
        self.port = srv.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> TlsProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def test_elevenlabs_sdk_convert_realtime_through_tls(server, tmp_path, monkeypatch):
    client_mod = pytest.importorskip("elevenlabs.client", reason="the elevenlabs SDK is not installed")
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the SDK's websockets client trusts the default store
    port = int(server.base_url.rsplit(":", 1)[1])
    with TlsProxy(cert, key, port) as proxy:
        client = client_mod.ElevenLabs(api_key="unused", base_url=f"https://127.0.0.1:{proxy.port}")
        chunks = list(client.text_to_speech.convert_realtime(
            voice_id="tara", text=iter(["Hello ", "there. ", "How are ", "you?"]), output_format="pcm_16000",
        ))
    pcm = np.frombuffer(b"".join(chunks), "<i2")
    assert pcm.size > 0 and os.environ["SSL_CERT_FILE"] == str(cert)


def test_elevenlabs_sdk_http_stream(server):
    client_mod = pytest.importorskip("elevenlabs.client", reason="the elevenlabs SDK is not installed")
    client = client_mod.ElevenLabs(api_key="unused", base_url=server.base_url)
    data = b"".join(client.text_to_speech.stream(voice_id="tara", text="Hello there.", output_format="mp3_44100_128"))
    from streaming.encoders import resolve_format
    from tests.streaming.decode import decode

    samples, rate = decode(data, resolve_format("mp3_44100_128"))
    assert rate == 44100 and samples.size > 0
