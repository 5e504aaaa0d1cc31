"""vLLM's request checks and response extensions that the OpenAI handlers share: the probes vLLM
answers with a 400 (so a client written against vLLM sees the same refusals) and the
``prompt_logprobs`` field in vLLM's shape."""
from __future__ import annotations

from appliance.server.protocol import OpenAIError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_compat_probes(req) -> None:
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "stream_options is only allowed when stream is true (got stream=false)",
                          param="stream_options", code="invalid_value")
    if req.seed is not None and not INT64_MIN <= req.seed <= INT64_MAX:
        raise OpenAIError(400, f"seed must be in the int64 range [{INT64_MIN}, {INT64_MAX}], got {req.seed}",
                          param="seed", code="invalid_value")
    if req.prompt_logprobs is not None and req.stream:
        raise OpenAIError(400, "prompt_logprobs is not available when stream is true", param="prompt_logprobs",
                          code="invalid_value")


def prompt_logprobs_json(lps: list | None, ids: list[int], k: int, k_engine: int, token_str) -> list | None:
    """The engine's prompt logprobs (None for the first token, then ``{token_id: logprob}`` holding
    the prompt token and the engine's top ``k_engine`` alternatives) as vLLM returns them: the prompt
    token, then the top ``k``, each ``{token_id: {logprob, rank, decoded_token}}``. ``rank`` is
    1-based in the vocabulary; the engine keeps only its top ``k_engine``, so a prompt token outside
    them gets rank None (vLLM's Logprob type allows None)."""
    if lps is None:
        return None
    out: list = []
    for i, d in enumerate(lps):
        if d is None:
            out.append(None)
            continue
        tok = ids[i]
        # the engine's dict has k_engine entries when the prompt token is among its top k, else k_engine + 1
        in_top = k_engine > 0 and len(d) == k_engine
        top = [(t, lp) for t, lp in sorted(d.items(), key=lambda kv: -kv[1]) if in_top or t != tok][:k_engine]
        rank = next((r for r, (t, _) in enumerate(top, start=1) if t == tok), None)
        entry = {str(tok): {"logprob": d[tok], "rank": rank, "decoded_token": token_str(tok)}}
        for r, (t, lp) in enumerate(top[:k], start=1):
            if t != tok:
                entry[str(t)] = {"logprob": lp, "rank": r, "decoded_token": token_str(t)}
        out.append(entry)
    return out


def top_k_of(d: dict | None, tok: int, k: int) -> dict | None:
    """``{token_id: logprob}`` cut to the top ``k`` plus ``tok`` (the engine computed more for
    prompt_logprobs than echo's logprobs asked for)."""
    if d is None:
        return None
    keep = {t for t, _ in sorted(d.items(), key=lambda kv: -kv[1])[:k]} | {tok}
    return {t: v for t, v in d.items() if t in keep}
