"""runner/engine/admission.py: each refusal names its field and says why."""

import pytest

from runner.engine.admission import check_layers, check_prompt
from streaming.sampling_params import InvalidRequest


@pytest.mark.parametrize("ids,kv_tokens,why", [
    ([], 64, "must not be empty"),
    ([1, 100], 64, "token 100 at index 1 is outside the vocabulary [0, 100)"),
    ([1, True, 2.0], 64, "token 2.0 at index 2"),
    (list(range(10)), 64, "prompt of 10 tokens leaves no room under max_model_len=10"),
    (list(range(8)), 8, "does not fit in the KV cache"),
])
def test_prompt_refusals(ids, kv_tokens, why):
    with pytest.raises(InvalidRequest, match="prompt_token_ids") as e:
        check_prompt(ids, vocab_size=100, max_model_len=10, kv_tokens=kv_tokens)
    assert why in str(e.value)


def test_a_prompt_leaving_room_passes_and_layers_count_from_either_end():
    check_prompt(list(range(9)), vocab_size=100, max_model_len=10, kv_tokens=10)
    check_layers((0, 4, -1, -5), num_layers=4)
    for bad in (5, -6):
        with pytest.raises(InvalidRequest, match=r"hidden_state_layers.*out of range \[-5, 4\]"):
            check_layers((bad,), num_layers=4)
