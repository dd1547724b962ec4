"""The vLLM engine process against transformers and the native engine, on a tiny random Llama:
greedy tokens identical, hidden states of chosen layers within fp32 tolerance for prompt and
decode positions, each position exactly once, streamed per step; across chunked prefill
(a 32-token step budget), prefix-cache hits, requests joining mid-run; abort and bad input.
One engine process (vLLM start-up is ~20 s) serves the module."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

import pytest_asyncio  # noqa: E402
import torch  # noqa: E402

from runner.engine.args import engine_args  # noqa: E402
from streaming import ipc  # noqa: E402
from streaming.sampling_params import InvalidRequest, SamplingParams  # noqa: E402
from tests.support.tiny_models import load_hf  # noqa: E402
from tests.vllm.conftest import vllm_engine_client  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

BUDGET = 32  # tokens per step: longer prompts prefill in chunks
NEW = 12


@pytest.fixture(scope="module")
def hf(vllm_llama):
    return load_hf(vllm_llama)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(vllm_llama):
    args = engine_args(vllm_llama, max_num_seqs=8, max_num_batched_tokens=BUDGET, max_model_len=256,
                       kv_memory_gb=0.02, enforce_eager=True, log_level="WARNING")
    async with vllm_engine_client(args) as c:
        yield c


def prompt_of(n: int, salt: int, vocab: int = 512) -> list[int]:
    return [(salt * 31 + 7 * i + 3) % vocab for i in range(n)]


def hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                      min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


async def collect(client, rid, prompt, sp=GREEDY, layers=()):
    """-> (tokens, outputs) of one request run to its end."""
    toks, outs = [], []
    async for o in client.generate(ipc.AddRequest(rid, prompt, sp, hidden_state_layers=list(layers))):
        toks += o.new_token_ids
        outs.append(o)
    return toks, outs


def rows_of(outs) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    hidden = [o for o in outs if o.hidden is not None]
    return torch.cat([torch.from_numpy(o.hidden.copy()) for o in hidden]), [tuple(o.hidden_positions) for o in hidden]


async def test_greedy_tokens_equal_transformers_and_native_with_requests_joining(client, hf, vllm_llama):
    from runner.config import EngineConfig
    from runner.engine.engine import Engine

    prompts = [prompt_of(n, i) for i, n in enumerate([1, 7, 33, 48, 70])]
    first = asyncio.create_task(collect(client, "j0", prompts[0], SamplingParams(temperature=0.0, max_tokens=40,
                                                                              ignore_eos=True)))
    await asyncio.sleep(0.3)  # the others join while it decodes
    rest = await asyncio.gather(*(collect(client, f"j{i}", p) for i, p in enumerate(prompts[1:], 1)))
    got = [(await first)[0][:NEW]] + [t for t, _ in rest]
    native = Engine(EngineConfig.build(vllm_llama, max_model_len=256, device="cpu"))
    assert got == native.generate(prompts, GREEDY)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(hf, p, NEW)


@pytest.mark.parametrize("layers", [(0, 1, 2), (-1, 1)])
async def test_hidden_states_equal_transformers_each_position_once(client, hf, layers):
    prompt = prompt_of(75, 5)  # three prefill chunks
    neighbour = asyncio.create_task(collect(client, "n", prompt_of(20, 9)))
    toks, outs = await collect(client, "h", prompt, layers=layers)
    await neighbour
    hid, spans = rows_of(outs)
    seq = prompt + toks[:-1]  # the last sampled token is never fed back
    assert hid.shape == (len(seq), len(layers), hf.config.hidden_size)
    # contiguous from position 0, each position once; the prompt arrives chunk by chunk before
    # the first token, then one row per decode step
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] == len(seq)
    # the prompt is computed in BUDGET-token chunks, then one position per decode step; the
    # engine sends the rows pending when it reads vLLM's output, so a slow read joins
    # consecutive steps into one span (seen: [64, 11] for [32, 32, 11]). So: every span inside
    # the prompt ends on a chunk boundary, one ends with the prompt, and no token comes before it
    k = [b for a, b in spans].index(len(prompt))
    assert all(b % BUDGET == 0 for a, b in spans[:k]), spans
    assert not any(o.new_token_ids for o in [o for o in outs if o.hidden is not None][:k])
    with torch.no_grad():
        ref = hf(torch.tensor([seq]), output_hidden_states=True)
    for j, layer in enumerate(layers):
        torch.testing.assert_close(hid[:, j], ref.hidden_states[layer][0], atol=1e-4, rtol=1e-4)
    assert toks == ref.logits[0, len(prompt) - 1 :].argmax(-1).tolist()


async def test_prefix_cache_hit_and_hidden_rows_of_a_cached_prompt(client, hf):
    prompt = prompt_of(200, 11)  # past the CPU build's 128-token block: a full block is cached
    t1, o1 = await collect(client, "p1", prompt)
    t2, o2 = await collect(client, "p2", prompt)
    assert t1 == t2 and o2[-1].num_cached_tokens >= 128
    # a request that asks for hidden states computes every position (as on the native engine)
    t3, o3 = await collect(client, "p3", prompt, layers=(2,))
    hid, spans = rows_of(o3)
    assert t3 == t1 and spans[0][0] == 0 and hid.shape[0] == len(prompt) + NEW - 1
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + t3[:-1]]), output_hidden_states=True)
    torch.testing.assert_close(hid[:, 0], ref.hidden_states[2][0], atol=1e-4, rtol=1e-4)


async def test_abort_mid_run_frees_the_request_and_the_engine_keeps_serving(client):
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    n = 0
    async for o in client.generate(ipc.AddRequest("long", prompt_of(10, 3), sp)):
        n += len(o.new_token_ids)
        if n >= 3:
            break  # the consumer leaves: EngineClient sends AbortRequests
    for _ in range(50):
        stats = await client.stats()
        if not stats.active_request_ids:
            break
        await asyncio.sleep(0.1)
    assert stats.active_request_ids == [] and stats.num_aborted_total >= 1
    assert (await collect(client, "after", prompt_of(5, 4)))[0]


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt_token_ids=[1, 512]), "prompt_token_ids"),
    (dict(prompt_token_ids=[]), "prompt_token_ids"),
    (dict(hidden_state_layers=[3]), "hidden_state_layers"),
    (dict(sampling=SamplingParams(top_p=0.0)), "sampling.top_p"),
    (dict(audio=True), "audio"),
    (dict(prompt_frames=[[1, 2]]), "prompt_frames"),
])
async def test_bad_input_names_the_field(client, kwargs, field):
    req = ipc.AddRequest(**{"request_id": "bad", "prompt_token_ids": [1, 2, 3], **kwargs})
    with pytest.raises(InvalidRequest) as e:
        async for _ in client.generate(req):
            pass
    assert e.value.field == field


async def test_voice_upload_answers_as_the_native_engine(client):
    """EncodeAudio gets its EncodedAudio answer (here: the model has no codec)."""
    with pytest.raises(InvalidRequest) as e:
        await client.encode_audio(b"\x00\x00" * 2048)
    assert e.value.field == "audio"
