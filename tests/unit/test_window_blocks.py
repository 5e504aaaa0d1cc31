"""The admission bound for windowed models (kv_cache_manager.max_blocks_held) against a brute-force
count of the blocks a request holds at every step position and chunk size, and the server's 400 using
the same bound."""
from __future__ import annotations

import pytest

from appliance.engine.kv_cache_manager import cdiv, max_blocks_held
from appliance.sampling_params import SamplingParams
from appliance.server.openai_serving import OpenAIServing
from appliance.server.protocol import OpenAIError


def held_at(c: int, n: int, bs: int, window: int) -> int:
    """Blocks held by a step at position c scheduling n tokens: up to the block of c + n - 1, minus
    the leading ones released because the query at c cannot see them (free_out_of_window)."""
    return cdiv(c + n, bs) - max(0, c - window + 1) // bs


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 3, 8, 33])
@pytest.mark.parametrize("max_chunk", [1, 5, 64])
def test_bound_is_the_worst_step_and_is_reached(bs, window, max_chunk):
    for total in (1, 7, 40, 130):
        worst = max(held_at(c, n, bs, window)
                    for c in range(total) for n in range(1, min(max_chunk, total - c) + 1))
        bound = max_blocks_held(total, bs, window, max_chunk)
        assert worst <= bound
        if total >= window + max_chunk + 2 * bs:  # long enough for the worst alignment to occur
            assert worst == bound, (total, worst, bound)
        assert max_blocks_held(total, bs, None, max_chunk) == cdiv(total, bs)


def _serving(window):
    s = object.__new__(OpenAIServing)
    s.info = {"max_model_len": 4096, "vocab_size": 100, "block_size": 4, "num_kv_blocks": 6,
              "kv_sliding_window": window, "max_chunk_tokens": 4}
    return s


def test_server_admits_by_the_same_bound():
    ids = list(range(1, 42))
    _serving(8).check_prompt(ids, SamplingParams(max_tokens=20))  # 61 tokens, 4 blocks at once
    with pytest.raises(OpenAIError, match=r"needs 16 KV blocks of 4 tokens at once; the whole KV cache holds 6"):
        _serving(None).check_prompt(ids, SamplingParams(max_tokens=20))
