"""/v1/embeddings (OpenAI's, with vLLM's extensions): input -> token ids -> one pooling request per
input in the engine core -> vectors, as floats or base64 (little-endian float32, as OpenAI sends).

Only a pooling runner serves it; a generate runner answers 400, and a pooling runner answers 400 to
the generation routes (``require_runner``), in vLLM's words. Every input is checked here before
anything reaches the engine: empty, out-of-vocabulary, longer than max_model_len (unless
``truncate_prompt_tokens`` keeps its last tokens), ``dimensions`` on a model that is not matryoshka.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import struct
import time
import uuid
from typing import Literal, Union

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from appliance.engine.kv_cache_manager import max_blocks_held
from appliance.pooling_params import PoolingParams
from appliance.server.async_engine import EngineDeadError
from appliance.server.protocol import OpenAIError, _Base

log = logging.getLogger("appliance.server")
# the API each runner serves, in vLLM's words for the refusal
_API_NAMES = {"generate": ("Completions API", "Chat Completions API"), "pooling": ("Embeddings API",)}


class EmbeddingRequest(_Base):
    model: str | None = None
    input: Union[list[int], list[list[int]], str, list[str]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None


def require_runner(serving, runner: str, api: str) -> None:
    """400 unless the server's engine runs with ``runner`` (``api``: the API's name for the message)."""
    have = serving.info.get("runner", "generate")
    if have != runner:
        raise OpenAIError(400, f"The model does not support {api}: this server runs it with --runner {have} "
                               f"(the {api} needs --runner {runner})", param="model", code="model_not_supported")


def _inputs(serving, req: EmbeddingRequest) -> list[list[int]]:
    inp = req.input
    if isinstance(inp, str) or (inp and isinstance(inp[0], int)):
        inp = [inp]
    if not inp:
        raise OpenAIError(400, "input must not be empty (give a string, a list of strings, a list of token ids "
                               "or a list of lists of token ids)", param="input")
    vocab = serving.info["vocab_size"]
    out = []
    for i, item in enumerate(inp):
        if isinstance(item, str):
            ids = serving.tokenizer.encode(item, add_special_tokens=req.add_special_tokens) if item else []
        else:
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise OpenAIError(400, f"input[{i}]: token ids must be in [0, {vocab}); got {bad[:5]}",
                                  param="input")
        if not ids:
            raise OpenAIError(400, f"input[{i}] is empty", param="input")
        out.append(ids)
    return out


def _check(serving, req: EmbeddingRequest, prompts: list[list[int]], model: str) -> list[list[int]]:
    max_len, hidden = serving.info["max_model_len"], serving.info["hidden_size"]
    k = req.truncate_prompt_tokens
    if k is not None:
        if not 1 <= k <= max_len:
            raise OpenAIError(400, f"truncate_prompt_tokens must be in [1, {max_len}] (max_model_len); got {k}",
                              param="truncate_prompt_tokens")
        prompts = [ids[-k:] for ids in prompts]  # vLLM keeps the last k tokens
    for i, ids in enumerate(prompts):
        if len(ids) > max_len:
            raise OpenAIError(400, f"input[{i}] is {len(ids)} tokens; this model's maximum context length "
                                   f"(max_model_len) is {max_len} tokens (truncate_prompt_tokens keeps the last "
                                   f"tokens)", param="input", code="context_length_exceeded")
    d = req.dimensions
    if d is not None:
        allowed, only = serving.info["matryoshka"], serving.info["matryoshka_dimensions"]
        if not allowed:
            raise OpenAIError(400, f"dimensions={d}: model {model!r} does not support matryoshka representation, "
                                   f"so its output dimensions ({hidden}) cannot be changed", param="dimensions")
        if d < 1 or d > hidden:
            raise OpenAIError(400, f"dimensions must be in [1, {hidden}] (the model's hidden size); got {d}",
                              param="dimensions")
        if only is not None and d not in only:
            raise OpenAIError(400, f"dimensions={d}: model {model!r} supports only the matryoshka dimensions "
                                   f"{only}", param="dimensions")
    blocks, bs = serving.info["num_kv_blocks"], serving.info["block_size"]
    for i, ids in enumerate(prompts):
        need = max_blocks_held(len(ids), bs, serving.info["kv_sliding_window"], serving.info["max_chunk_tokens"])
        if need > blocks:
            raise OpenAIError(400, f"input[{i}] ({len(ids)} tokens) needs {need} KV blocks of {bs} tokens at once; "
                                   f"the whole KV cache holds {blocks}", param="input")
    return prompts


def encode_base64(vec: list[float]) -> str:
    """OpenAI's base64 form: the vector as little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


async def create_embedding(serving, req: EmbeddingRequest, http: HTTPRequest):
    serving.check_model(req.model)
    require_runner(serving, "pooling", "Embeddings API")
    model = req.model or serving.served_model_names[0]
    prompts = _check(serving, req, _inputs(serving, req), model)
    params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    request_id = f"embd-{uuid.uuid4().hex}"
    serving.admit(len(prompts))
    q: asyncio.Queue = asyncio.Queue()
    streams = []
    for i, ids in enumerate(prompts):
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        try:
            streams.append(serving.client.add_request(rid, ids, params, queue=q))
        except EngineDeadError as e:
            serving.abort(streams)
            raise OpenAIError(503, str(e), type="service_unavailable", code="engine_dead") from None
    log.info("%s: embeddings inputs=%d prompt_tokens=%d", request_id, len(prompts), sum(map(len, prompts)))
    vectors = await _collect(serving, streams, http)
    if vectors is None:
        return Response(status_code=499)  # client closed the request (nginx's code); never sent
    data = [{"index": i, "object": "embedding",
             "embedding": encode_base64(v) if req.encoding_format == "base64" else v}
            for i, v in enumerate(vectors)]
    n = sum(len(ids) for ids in prompts)
    body = {"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n}}
    return JSONResponse(body, headers={"X-Request-Id": request_id})


async def _collect(serving, streams, http: HTTPRequest) -> list[list[float]] | None:
    """Every stream's vector in input order, or None if the client went away (then aborted)."""
    index = {s.request_id: i for i, s in enumerate(streams)}
    vectors: list = [None] * len(streams)

    def fold(d) -> None:
        if d.embedding is not None:
            vectors[index[d.request_id]] = d.embedding

    return vectors if await serving.run_to_end(streams, http, fold) else None
