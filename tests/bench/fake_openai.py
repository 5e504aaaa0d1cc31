"""A fake OpenAI-compatible server with known, injected delays (for the load generator tests)."""
from __future__ import annotations

import asyncio
import json

from fastapi import Request  # module level: FastAPI resolves the string annotations here

# The fake server's injected timing: the first token after TTFT seconds, then one every GAP seconds.
FAKE_TTFT, FAKE_GAP, FAKE_TOKENS = 0.25, 0.05, 8


def fake_app():
    """Streams FAKE_TOKENS tokens with the injected delays. The model name picks a behaviour:
    ``ok``, ``http500`` (an error status), ``streamerror`` (an error chunk after one token)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse


    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "ok", "object": "model"}]}

    async def handle(req: Request, chat: bool):
        body = await req.json()
        mode = body["model"]
        if mode == "http500":
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        n = body.get("max_tokens") or FAKE_TOKENS

        def chunk(i):
            choice = ({"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None} if chat
                      else {"index": 0, "text": f"t{i} ", "finish_reason": None})
            return "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"

        async def stream():
            if chat:  # the role-only first chunk real servers send: not a token
                yield "data: " + json.dumps({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
            await asyncio.sleep(FAKE_TTFT)
            for i in range(n):
                if i:
                    await asyncio.sleep(FAKE_GAP)
                if mode == "streamerror" and i == 1:
                    yield "data: " + json.dumps({"error": {"message": "injected stream error"}}) + "\n\n"
                    return
                yield chunk(i)
            yield "data: " + json.dumps({"id": "x", "choices": [], "usage": {
                "prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await handle(req, chat=True)

    return app
