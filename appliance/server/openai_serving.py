"""/v1/completions and /v1/chat/completions: requests -> token ids + SamplingParams -> engine
deltas -> OpenAI responses or Server-Sent Events.

Every request is checked here before anything reaches the engine (same limits as
``LLMEngine.add_request``), so a bad request costs the engine nothing and gets its 400 before a
stream starts. A request whose client goes away is aborted, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from appliance.engine.kv_cache_manager import max_blocks_held
from appliance.errors import InvalidRequestError
from appliance.sampling_params import SamplingParams, check_logit_bias_vocab
from appliance.server import chat_tools
from appliance.server.async_engine import (
    AsyncEngineClient, EngineDeadError, RequestAborted, RequestStream, iterate_streams,
)
from appliance.server.engine_core import RequestDelta
from appliance.server.metrics import ServerMetrics
from appliance.server.protocol import (
    ChatCompletionRequest, CompletionRequest, OpenAIError, message_dicts,
)
from appliance.generation_defaults import apply_defaults
from appliance.server.vllm_extras import check_compat_probes, prompt_logprobs_json, top_k_of
from appliance.structured.requests import from_request

log = logging.getLogger("appliance.server")
_DISCONNECT_POLL_S = 0.5


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class _Choice:
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c) -> None:
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + c.logprobs
        self.cumulative_logprob = c.cumulative_logprob
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


class OpenAIServing:
    def __init__(self, client: AsyncEngineClient, tokenizer, served_model_names: list[str],
                 metrics: ServerMetrics, max_queued_requests: int | None,
                 chat_options: chat_tools.ChatOptions | None = None):
        self.client = client
        self.chat_options = chat_options or chat_tools.ChatOptions()
        self.tokenizer = tokenizer
        self.info = client.info
        self.served_model_names = served_model_names
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.draining = False
        self.started = time.time()
        self.default_sampling: dict = {}  # the model's generation defaults (--generation-config auto)
        self._token_str: dict[int, str] = {}
        client.on_delta = self._on_delta
        client.tokenizer = tokenizer

    # -- checks -------------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            raise OpenAIError(404, f"The model {name!r} does not exist; this server serves "
                                   f"{', '.join(repr(n) for n in self.served_model_names)}",
                              param="model", code="model_not_found")

    def admit(self, num_seqs: int) -> None:
        """Refuse work while shutting down, or beyond max_num_seqs + --max-queued-requests sequences."""
        if self.draining:
            self.metrics.rejected += 1
            raise OpenAIError(503, "the server is shutting down", type="service_unavailable",
                              code="server_shutting_down")
        if self.max_queued_requests is None:
            return
        in_flight = sum(s.num_seqs for s in self.client.streams.values())
        limit = self.info["max_num_seqs"] + self.max_queued_requests
        if in_flight + num_seqs > limit:
            self.metrics.rejected += 1
            raise OpenAIError(
                503, f"the server is at capacity: {in_flight} sequences in flight, the limit is {limit} "
                     f"(max_num_seqs={self.info['max_num_seqs']} + max_queued_requests={self.max_queued_requests}); "
                     f"retry later", type="server_overloaded", code="server_overloaded", headers={"Retry-After": "1"})

    def check_prompt(self, ids: list[int], params: SamplingParams, param: str = "prompt") -> None:
        max_len, vocab = self.info["max_model_len"], self.info["vocab_size"]
        if not ids:
            raise OpenAIError(400, "the prompt is empty", param=param)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", param=param)
        n = len(ids)
        if n >= max_len:
            raise OpenAIError(400, f"This model's maximum context length is {max_len} tokens, but the prompt has "
                                   f"{n} tokens (no room left to generate)", param=param,
                              code="context_length_exceeded")
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - n
        if n + max_tokens > max_len:
            raise OpenAIError(400, f"This model's maximum context length is {max_len} tokens, but the prompt has "
                                   f"{n} tokens and max_tokens is {max_tokens} ({n + max_tokens} in total)",
                              param="max_tokens", code="context_length_exceeded")
        try:
            check_logit_bias_vocab(params.logit_bias, vocab)
        except InvalidRequestError as e:
            raise OpenAIError(400, str(e), param=e.param, code="invalid_value") from None
        bs, blocks = self.info["block_size"], self.info["num_kv_blocks"]
        need = max_blocks_held(n + max_tokens, bs, self.info["kv_sliding_window"], self.info["max_chunk_tokens"])
        if need > blocks:
            raise OpenAIError(400, f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) needs {need} KV blocks "
                                   f"of {bs} tokens at once; the whole KV cache holds {blocks}", param="max_tokens")

    @staticmethod
    def sampling_params(req, max_tokens, logprobs, prompt_logprobs=None, defaults=None) -> SamplingParams:
        check_compat_probes(req)
        if req.prompt_logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, req.prompt_logprobs)
        kw = dict(logit_bias=req.logit_bias, structured_outputs=from_request(req),
                  n=req.n, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                  min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, stop=req.stop,
                  stop_token_ids=req.stop_token_ids, seed=req.seed, skip_special_tokens=req.skip_special_tokens,
                  include_stop_str_in_output=req.include_stop_str_in_output)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(req, name)
            if v is not None:
                kw[name] = v
        if defaults:  # the model's generation config (--generation-config auto); the request's values win
            kw = apply_defaults(kw, defaults)
        try:
            return SamplingParams(**kw)
        except InvalidRequestError as e:
            raise OpenAIError(400, str(e), param=e.param, code="invalid_value") from None

    # -- engine plumbing -----------------------------------------------------------------------------
    def _on_delta(self, stream: RequestStream, d: RequestDelta) -> None:
        now = time.monotonic()
        new = sum(len(c.token_ids) for c in d.choices)
        if new:
            if stream.first_token_time is None:
                stream.first_token_time = now
            elif stream.last_token_time is not None:
                self.metrics.itl.observe(now - stream.last_token_time)
            stream.last_token_time = now
        stream.num_output_tokens += new
        if d.first and d.queue_time is not None:
            self.metrics.queue.observe(d.queue_time)
        for c in d.choices:
            if c.finish_reason is not None:
                stream.finish_reasons[c.index] = c.finish_reason
        if d.embedding is not None:  # a pooling request ends with its vector
            stream.finish_reasons[0] = "stop"
        if d.finished:
            self._record_finish(stream)

    def _record_finish(self, stream: RequestStream) -> None:
        now = time.monotonic()
        e2e = now - stream.arrival
        ttft = None if stream.first_token_time is None else stream.first_token_time - stream.arrival
        reasons = [stream.finish_reasons.get(i, "abort") for i in range(stream.num_seqs)]
        for i, r in enumerate(reasons):
            self.metrics.finish(r, stream.num_prompt_tokens if i == 0 else 0,
                                stream.num_output_tokens if i == 0 else 0, ttft, e2e)
        self.metrics.observe_request(stream.num_prompt_tokens, stream.num_output_tokens)
        log.info("%s: finished (%s) prompt_tokens=%d output_tokens=%d ttft=%s e2e=%.3fs", stream.request_id,
                 ",".join(reasons), stream.num_prompt_tokens, stream.num_output_tokens,
                 "-" if ttft is None else f"{ttft:.3f}s", e2e)

    def _start(self, request_id: str, prompts: list[list[int]], params: SamplingParams, kind: str):
        self.admit(len(prompts) * params.n)
        q: asyncio.Queue = asyncio.Queue()
        streams = []
        for i, ids in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            try:
                streams.append(self.client.add_request(rid, ids, params, queue=q))
            except EngineDeadError as e:
                self.abort(streams)
                raise OpenAIError(503, str(e), type="service_unavailable", code="engine_dead") from None
            log.info("%s: %s prompt_tokens=%d max_tokens=%s n=%d temperature=%s", rid, kind, len(ids),
                     params.max_tokens, params.n, params.temperature)
        return streams

    def abort(self, streams: list[RequestStream], notify: bool = False, why: str = "client went away") -> None:
        """Abort the unfinished ones among ``streams`` (frees their KV blocks in the core)."""
        live = [s for s in streams if not s.finished and s.request_id in self.client.streams]
        if live:
            self.client.abort([s.request_id for s in live], notify=notify)
            for s in live:
                log.info("%s: aborted (%s)", s.request_id, why)
                self._record_finish(s)

    def abort_all(self) -> None:
        self.abort(list(self.client.streams.values()), notify=True, why="server shutting down")

    async def _collect(self, streams: list[RequestStream], http: HTTPRequest):
        """All deltas of ``streams`` folded into choices, or (None, None) if the client disconnected
        (the requests are then aborted)."""
        index = {s.request_id: i for i, s in enumerate(streams)}
        n = streams[0].num_seqs
        choices = [[_Choice() for _ in range(n)] for _ in streams]
        prompt_logprobs: list = [None] * len(streams)

        def fold(d) -> None:
            i = index[d.request_id]
            if d.first:
                prompt_logprobs[i] = d.prompt_logprobs
            for c in d.choices:
                choices[i][c.index].add(c)

        if not await self.run_to_end(streams, http, fold):
            return None, None
        return choices, prompt_logprobs

    async def run_to_end(self, streams: list[RequestStream], http: HTTPRequest, fold) -> bool:
        """Feed every delta of ``streams`` to ``fold`` until all finish (True), or until the client
        disconnects (False); either way nothing of these requests is left running. Engine-side
        refusals become OpenAI errors (400, 503 aborted, 500 engine dead)."""
        async def consume():
            async for d in iterate_streams(streams):
                fold(d)

        task = asyncio.ensure_future(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    try:
                        task.result()
                    except InvalidRequestError as e:  # refused by the engine after our own checks
                        raise OpenAIError(400, str(e), param=e.param) from None
                    except RequestAborted as e:
                        raise OpenAIError(503, str(e), type="service_unavailable", code="aborted") from None
                    except EngineDeadError as e:
                        raise OpenAIError(500, str(e), type="internal_error", code="engine_dead") from None
                    return True
                if await http.is_disconnected():
                    return False  # the finally below aborts; nobody is left to answer
        finally:
            if not task.done():
                task.cancel()
            self.abort(streams)

    # -- token strings -------------------------------------------------------------------------------
    def token_str(self, tid: int) -> str:
        s = self._token_str.get(tid)
        if s is None:
            s = self._token_str[tid] = self.tokenizer.decode([tid], skip_special_tokens=False,
                                                              clean_up_tokenization_spaces=False)
        return s

    def _completion_logprobs(self, token_ids, lps, offset: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp in zip(token_ids, lps):
            tok = self.token_str(tid)
            out["tokens"].append(tok)
            out["text_offset"].append(offset)
            offset += len(tok)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(lp[tid])
                out["top_logprobs"].append({self.token_str(t): v for t, v in
                                            sorted(lp.items(), key=lambda kv: -kv[1])})
        return out

    def _chat_logprobs(self, token_ids, lps, k: int) -> list[dict]:
        out = []
        for tid, lp in zip(token_ids, lps):
            tok = self.token_str(tid)
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
            out.append({"token": tok, "logprob": lp[tid], "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": [{"token": self.token_str(t), "logprob": v,
                                          "bytes": list(self.token_str(t).encode("utf-8"))} for t, v in top]})
        return out

    # -- /v1/completions -----------------------------------------------------------------------------
    def _completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, self.tokenizer.encode(p, add_special_tokens=True) if p else []))
            else:
                out.append((None, list(p)))
        return out

    async def completions(self, req: CompletionRequest, http: HTTPRequest):
        self.check_model(req.model)
        if req.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError(400, f"best_of must equal n (got best_of={req.best_of}, n={req.n}); "
                                   "best-of sampling is not supported", param="best_of")
        prompts = self._completion_prompts(req.prompt)
        params = self.sampling_params(req, req.max_tokens, req.logprobs,
                                      prompt_logprobs=req.logprobs if (req.echo and req.logprobs is not None) else None,
                                      defaults=self.default_sampling)
        for _, ids in prompts:
            self.check_prompt(ids, params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        model = req.model or self.served_model_names[0]
        created = int(time.time())
        streams = self._start(request_id, [ids for _, ids in prompts], params, "completion")
        texts = [t if t is not None else self.tokenizer.decode(ids) for t, ids in prompts]
        if req.stream:
            gen = self._stream_completion(req, streams, prompts, texts, request_id, model, created)
            return self._sse(gen, streams, request_id)

        choices, prompt_lps = await self._collect(streams, http)
        if choices is None:
            return Response(status_code=499)  # client closed the request (nginx's code); never sent
        out = []
        for i, (_, ids) in enumerate(prompts):
            for c in choices[i]:
                text = (texts[i] + c.text) if req.echo else c.text
                lp = None
                if req.logprobs is not None:
                    tok_ids, lps = list(c.token_ids), list(c.logprobs or [])
                    if req.echo:
                        plp = list(prompt_lps[i] or [None] * len(ids))
                        if params.prompt_logprobs != req.logprobs:  # prompt_logprobs asked for more alternatives
                            plp = [top_k_of(d, t, req.logprobs) for d, t in zip(plp, ids)]
                        tok_ids, lps = list(ids) + tok_ids, plp + lps
                    lp = self._completion_logprobs(tok_ids, lps, 0)
                out.append({"index": len(out), "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
                if req.prompt_logprobs is not None:
                    out[-1]["prompt_logprobs"] = prompt_logprobs_json(prompt_lps[i], ids, req.prompt_logprobs,
                                                                      params.prompt_logprobs, self.token_str)
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        completion_tokens = sum(len(c.token_ids) for cs in choices for c in cs)
        body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": out,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}
        return JSONResponse(body, headers={"X-Request-Id": request_id})

    async def _stream_completion(self, req, streams, prompts, texts, request_id, model, created):
        index = {s.request_id: i for i, s in enumerate(streams)}
        n = streams[0].num_seqs
        offsets = [[0] * n for _ in streams]
        completion_tokens = 0

        def chunk(choices):
            return sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                        "choices": choices})

        async for d in iterate_streams(streams):
            i = index[d.request_id]
            ids = prompts[i][1]
            out = []
            for c in d.choices:
                completion_tokens += len(c.token_ids)
                text, tok_ids, lps = c.text, list(c.token_ids), list(c.logprobs or [])
                if req.echo and d.first:
                    text = texts[i] + text
                    tok_ids = list(ids) + tok_ids
                    lps = list(d.prompt_logprobs or [None] * len(ids)) + lps
                if not text and not tok_ids and c.finish_reason is None:
                    continue  # nothing new (a chunk per new token even when its text is held back, as vLLM)
                lp = None
                if req.logprobs is not None:
                    lp = self._completion_logprobs(tok_ids, lps, offsets[i][c.index])
                    offsets[i][c.index] += sum(len(t) for t in lp["tokens"])
                out.append({"index": i * n + c.index, "text": text, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if out:
                yield chunk(out)
        if req.stream_options and req.stream_options.include_usage:
            prompt_tokens = sum(len(ids) for _, ids in prompts)
            yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                                "total_tokens": prompt_tokens + completion_tokens}})

    # -- /v1/chat/completions ------------------------------------------------------------------------
    def chat_prompt(self, messages, add_generation_prompt: bool, continue_final_message: bool = False,
                    kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
        tok = self.tokenizer
        opts = self.chat_options
        if not getattr(tok, "chat_template", None) and opts.chat_template is None:
            raise OpenAIError(400, "this model has no chat template; use /v1/completions or start the server with "
                                   "--chat-template", param="messages")
        kwargs = chat_tools.template_kwargs(opts, kwargs)
        if opts.chat_template is not None:
            kwargs["chat_template"] = opts.chat_template
        try:
            text = tok.apply_chat_template(message_dicts(messages), tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt and not continue_final_message,
                                           continue_final_message=continue_final_message, **kwargs)
        except OpenAIError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja templates raise anything (e.g. role order checks)
            raise OpenAIError(400, f"the chat template rejected these messages: {e}", param="messages") from None
        return tok.encode(text, add_special_tokens=False)

    async def chat(self, req: ChatCompletionRequest, http: HTTPRequest):
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, f"top_logprobs={req.top_logprobs} needs logprobs=true", param="top_logprobs")
        k = req.top_logprobs or 0
        tools = chat_tools.check_tools(req.tools)
        tool_choice = chat_tools.check_tool_choice(req.tool_choice, tools, self.chat_options)
        chat_tools.check_tool_messages(req.messages)
        ids = self.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                               req.chat_template_kwargs, tools=tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, k if req.logprobs else None, defaults=self.default_sampling)
        self._tool_sampling(params, tool_choice, tools, req.parallel_tool_calls)
        if req.logprobs and not 0 <= k <= 20:
            raise OpenAIError(400, f"top_logprobs must be in [0, 20], got {k}", param="top_logprobs")
        self.check_prompt(ids, params, param="messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        model = req.model or self.served_model_names[0]
        created = int(time.time())
        streams = self._start(request_id, [ids], params, "chat")
        if req.stream:
            return self._sse(self._stream_chat(req, streams, ids, k, request_id, model, created, tool_choice),
                             streams, request_id)

        choices, prompt_lps = await self._collect(streams, http)
        if choices is None:
            return Response(status_code=499)
        out = []
        for c in choices[0]:
            lp = {"content": self._chat_logprobs(c.token_ids, c.logprobs or [], k)} if req.logprobs else None
            message = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            output = chat_tools.ChatOutput(self.chat_options, tool_choice, req.parallel_tool_calls)
            if output.active:
                message = output.message(c.text)
                if message.get("tool_calls") and finish_reason == "stop":
                    finish_reason = "tool_calls"
            out.append({"index": len(out), "message": message,
                        "logprobs": lp, "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in choices[0])
        body = {"id": request_id, "object": "chat.completion", "created": created, "model": model, "choices": out,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(ids) + completion_tokens}}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(prompt_lps[0], ids, req.prompt_logprobs,
                                                           params.prompt_logprobs, self.token_str)
        return JSONResponse(body, headers={"X-Request-Id": request_id})

    async def _stream_chat(self, req, streams, ids, k, request_id, model, created, tool_choice=None):
        n = streams[0].num_seqs
        outputs = [chat_tools.ChatOutput(self.chat_options, tool_choice or chat_tools.ToolChoice("none"),
                                         req.parallel_tool_calls) for _ in range(n)]

        def chunk(choices):
            return sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": choices})

        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(n)])
        completion_tokens = 0
        async for d in iterate_streams(streams):
            out = []
            for c in d.choices:
                completion_tokens += len(c.token_ids)
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue  # nothing new (a chunk per new token even when its text is held back, as vLLM)
                lp = {"content": self._chat_logprobs(c.token_ids, c.logprobs or [], k)} if req.logprobs else None
                if outputs[c.index].active:
                    out.extend(self._parsed_chunks(outputs[c.index], c, lp))
                    continue
                delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                out.append({"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
            # A parsed choice can give several deltas in one step: one chunk holds one delta per choice.
            while out:
                seen: set = set()
                first = [e for e in out if not (e["index"] in seen or seen.add(e["index"]))]
                out = [e for e in out if all(e is not f for f in first)]
                yield chunk(first)
        if req.stream_options and req.stream_options.include_usage:
            yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                                                "total_tokens": len(ids) + completion_tokens}})

    # -- tools and reasoning -----------------------------------------------------------------------
    def _tool_sampling(self, params: SamplingParams, tool_choice, tools, parallel) -> None:
        """tool_choice "required" or a named function: constrain the output to the tool-call JSON.
        "auto" with a format whose markers are special tokens: keep them in the text to parse."""
        parser = self.chat_options.tool_parser
        if tool_choice.mode == "auto" and parser is not None and parser.needs_special_tokens:
            params.skip_special_tokens = False
        if tool_choice.mode not in ("required", "named"):
            return
        if params.structured_outputs is not None:
            raise OpenAIError(400, f"tool_choice={tool_choice.mode!r} constrains the output itself; it cannot be "
                                   "combined with another structured output", param="tool_choice")
        from appliance.sampling_params import StructuredOutputsParams

        params.structured_outputs = StructuredOutputsParams(
            json=chat_tools.tool_choice_schema(tool_choice, tools, parallel))
        from appliance.structured.grammar import validate

        field = "tools" if tool_choice.mode == "required" else \
            f"tools.{[t['function']['name'] for t in tools].index(tool_choice.name)}.function.parameters"
        try:  # a parameters schema the grammar compiler cannot take is the client's to fix
            validate(params.structured_outputs, field)
        except InvalidRequestError as e:
            raise OpenAIError(400, str(e), param=e.param, code="invalid_value") from None

    @staticmethod
    def _parsed_chunks(output, c, lp) -> list[dict]:
        """One streamed choice through its reasoning / tool-call parsers: a chunk per delta, the
        logprobs on the first, the finish reason on a last empty one."""
        deltas = output.feed(c.text, final=c.finish_reason is not None)
        chunks = [{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if lp is not None:
            if not chunks:
                chunks.append({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": None})
            chunks[0]["logprobs"] = lp
        if c.finish_reason is not None:
            reason = "tool_calls" if output.called and c.finish_reason == "stop" else c.finish_reason
            chunks.append({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason,
                           "stop_reason": c.stop_reason})
        return chunks

    # -- SSE ---------------------------------------------------------------------------------------
    def _sse(self, gen, streams: list[RequestStream], request_id: str) -> StreamingResponse:
        async def body():
            try:
                async for item in gen:
                    yield item
            except InvalidRequestError as e:
                yield sse(OpenAIError(400, str(e), param=e.param).body())
            except RequestAborted as e:
                yield sse(OpenAIError(503, str(e), type="service_unavailable", code="aborted").body())
            except EngineDeadError as e:
                yield sse(OpenAIError(500, str(e), type="internal_error", code="engine_dead").body())
            except Exception:  # noqa: BLE001 - never a traceback on the wire
                log.exception("%s: stream failed", request_id)
                yield sse(OpenAIError(500, f"internal error (request {request_id})", type="internal_error").body())
            finally:
                # Runs on normal end, on error, and when the client disconnects (the response task
                # is cancelled): an unfinished request is aborted and its KV blocks freed.
                self.abort(streams)
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})
