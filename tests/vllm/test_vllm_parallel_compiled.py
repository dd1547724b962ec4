"""The vLLM backend over two CPU ranks, tensor parallel 2 and pipeline parallel 2, with vLLM's
compiled graph (no --enforce-eager): greedy tokens equal transformers, hidden rows of inner
layers (EAGLE-3 auxiliary outputs of the compiled graph; across the pipeline, handed from the
first stage to the last inside the intermediate tensors) within fp32 tolerance, each position
once."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import pytest_asyncio  # noqa: E402
import torch  # noqa: E402

from runner.engine.args import engine_args  # noqa: E402
from tests.support.tiny_models import load_hf  # noqa: E402
from tests.vllm.conftest import vllm_engine_client  # noqa: E402
from tests.vllm.test_vllm_engine import collect, hf_greedy, prompt_of, rows_of  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

# two ranks on two cores: one core each, none held back for the front end
TWO_RANKS_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@pytest_asyncio.fixture(scope="module", loop_scope="module",
                        params=["tensor_parallel_size", "pipeline_parallel_size"])
async def client(request, vllm_llama):
    args = engine_args(vllm_llama, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, kv_memory_gb=0.02,
                       log_level="WARNING", **{request.param: 2})
    async with vllm_engine_client(args, env=TWO_RANKS_ENV) as c:
        yield c


async def test_two_ranks_compiled_tokens_and_hidden_rows(client, vllm_llama):
    hf = load_hf(vllm_llama)
    prompt = prompt_of(40, 2)
    toks, outs = await collect(client, "tp", prompt, layers=(0, 1, 2))
    assert toks == hf_greedy(hf, prompt, len(toks))
    hid, spans = rows_of(outs)
    seq = prompt + toks[:-1]
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] == len(seq)
    with torch.no_grad():
        ref = hf(torch.tensor([seq]), output_hidden_states=True)
    for j in range(3):
        torch.testing.assert_close(hid[:, j], ref.hidden_states[j][0], atol=1e-4, rtol=1e-4)
