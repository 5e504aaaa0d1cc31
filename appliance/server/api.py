"""The FastAPI app: routes, auth, request logging and the OpenAI error shape for every failure.

Nothing here waits on the model: handlers tokenize, queue work for the engine core process and
await its deltas (see ``async_engine``). No response ever carries a traceback: unexpected errors
are logged here with the request id and answered with a plain 500.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

from fastapi import FastAPI
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

import appliance
from appliance.server import serving_embeddings
from appliance.server.openai_serving import OpenAIServing
from appliance.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, OpenAIError, TokenizeRequest, validation_error,
)
from appliance.server.request_fields import check_request_fields

log = logging.getLogger("appliance.server")
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def parse_body(http: Request, model_cls):
    raw = await http.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                          code="invalid_json")
    check_request_fields(model_cls, data)
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


class ServerMiddleware:
    """Pure ASGI (streams and disconnects pass through untouched): API-key check, one log line per
    response, and a last-resort 500 in OpenAI's shape."""

    def __init__(self, app, api_key: str | list[str] | None):
        self.app = app
        # several keys: any one authorises (vLLM's repeated --api-key)
        self.api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self.api_key = self.api_keys[0] if self.api_keys else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # uvicorn puts --root-path in front of the path
            path = path[len(root):] or "/"
        if self.api_key and path.startswith(_PROTECTED) and not self._authorized(scope):
            resp = error_response(OpenAIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                              code="invalid_api_key"))
            log.info("%s %s 401 (bad or missing API key)", method, path)
            return await resp(scope, receive, send)
        t0 = time.perf_counter()
        started = False

        async def send_logged(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                rid = next((v.decode() for k, v in message.get("headers", []) if k == b"x-request-id"), "-")
                if not (path in ("/health", "/metrics") and message["status"] == 200):
                    log.info("%s %s %d %.1fms id=%s", method, path, message["status"],
                             (time.perf_counter() - t0) * 1e3, rid)
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        except Exception:  # noqa: BLE001 - the traceback goes to the log, never to the client
            log.exception("%s %s failed", method, path)
            if not started:
                resp = error_response(OpenAIError(500, "internal server error", type="internal_error"))
                await resp(scope, receive, send)

    def _authorized(self, scope) -> bool:
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                scheme, _, token = v.decode("latin-1").partition(" ")
                token = token.strip().encode()
                # every key compared (no early exit), so timing does not tell which one nearly matched
                ok = [hmac.compare_digest(token, k.encode()) for k in self.api_keys]
                return scheme.lower() == "bearer" and any(ok)
        return False


def build_app(serving: OpenAIServing, api_key: str | None = None, on_startup=None, on_shutdown=None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        if on_startup is not None:
            on_startup(asyncio.get_running_loop())
        yield
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="appliance", version=appliance.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    client = serving.client
    info = serving.info

    @app.exception_handler(OpenAIError)
    async def _openai_error(_, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return error_response(OpenAIError(404, f"no route {http.method} {http.url.path}", code="not_found"))
        if e.status_code == 405:
            return error_response(OpenAIError(405, f"method {http.method} is not allowed on {http.url.path}",
                                              code="method_not_allowed"))
        return error_response(OpenAIError(e.status_code, str(e.detail)))

    @app.get("/health")
    async def health():
        if client.dead is not None:
            return error_response(OpenAIError(503, f"the engine failed: {client.dead}", type="service_unavailable"))
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": appliance.__version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(serving.started), "owned_by": "appliance",
             "root": info["model_path"], "parent": None, "max_model_len": info["max_model_len"]}
            for name in serving.served_model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in serving.served_model_names:
            raise OpenAIError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")
        return {"id": model_id, "object": "model", "created": int(serving.started), "owned_by": "appliance",
                "root": info["model_path"], "parent": None, "max_model_len": info["max_model_len"]}

    @app.get("/metrics")
    async def metrics():
        stats = await client.get_stats()
        return PlainTextResponse(serving.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(http: Request):
        serving_embeddings.require_runner(serving, "generate", "Completions API")
        return await serving.completions(await parse_body(http, CompletionRequest), http)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        serving_embeddings.require_runner(serving, "generate", "Chat Completions API")
        return await serving.chat(await parse_body(http, ChatCompletionRequest), http)

    @app.post("/v1/embeddings")
    async def embeddings(http: Request):
        req = await parse_body(http, serving_embeddings.EmbeddingRequest)
        return await serving_embeddings.create_embedding(serving, req, http)

    @app.post("/tokenize")
    async def tokenize(http: Request):
        req = await parse_body(http, TokenizeRequest)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.prompt is not None:
            ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = serving.chat_prompt(req.messages, req.add_generation_prompt)
        return {"count": len(ids), "max_model_len": info["max_model_len"], "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(http: Request):
        req = await parse_body(http, DetokenizeRequest)
        serving.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < info["vocab_size"]]
        if bad:
            raise OpenAIError(400, f"tokens must be in [0, {info['vocab_size']}); got {bad[:5]}", param="tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens)}

    app.add_middleware(ServerMiddleware, api_key=api_key)
    return app


def cors_values(items: list[str] | None, default: list[str]) -> list[str]:
    """Values of a CORS flag: each one a plain value or a JSON list (vLLM takes JSON lists)."""
    from appliance.errors import ApplianceError

    out = []
    for v in items or []:
        v = v.strip()
        if v.startswith("["):
            try:
                parsed = json.loads(v)
            except ValueError as e:
                raise ApplianceError(f"CORS flag value {v!r} is not a JSON list ({e})") from None
            if not isinstance(parsed, list):
                raise ApplianceError(f"CORS flag value {v!r} is not a JSON list")
            out.extend(str(x) for x in parsed)
        elif v:
            out.append(v)
    return out or default


def add_cors(app: FastAPI, server) -> None:
    """CORS with vLLM's flags; methods and headers default to all, as vLLM's do."""
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=cors_values(server.allowed_origins, []),
                       allow_methods=cors_values(server.allowed_methods, ["*"]),
                       allow_headers=cors_values(server.allowed_headers, ["*"]),
                       allow_credentials=server.allow_credentials)
