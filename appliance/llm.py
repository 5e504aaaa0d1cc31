"""The offline API, mirroring vLLM's: ``LLM(model=...).generate(prompts, params)`` and ``.chat``."""
from __future__ import annotations

from collections.abc import Sequence

from appliance.config import EngineConfig
from appliance.engine.llm_engine import EmbeddingRequestOutput, LLMEngine, RequestOutput
from appliance.pooling_params import PoolingParams
from appliance.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. A prompt is a string or
        a list of token ids. All prompts are validated before any is queued."""
        if prompt_token_ids is not None:
            items = [list(p) for p in prompt_token_ids]
        elif isinstance(prompts, str):
            items = [prompts]
        elif prompts and isinstance(prompts[0], int):
            items = [list(prompts)]
        else:
            items = list(prompts or [])
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"got {len(items)} prompts but {len(params)} sampling params")
        return self._run(items, params)

    def embed(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string or a list of token ids), in input order; needs
        ``runner="pooling"`` (or a pooling architecture). ``outputs.embedding`` is a list of floats."""
        if isinstance(prompts, str):
            items = [prompts]
        elif prompts and isinstance(prompts[0], int):
            items = [list(prompts)]
        else:
            items = list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            base = pooling_params or PoolingParams()
            if truncate_prompt_tokens is not None:
                base = PoolingParams(base.dimensions, base.normalize, truncate_prompt_tokens)
            params = [base] * len(items)
        else:
            params = list(pooling_params)
            if len(params) != len(items):
                raise ValueError(f"got {len(items)} prompts but {len(params)} pooling params")
        return self._run(items, params)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompt_token_ids=prompts, sampling_params=sampling_params)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        tok = self.engine.tokenizer
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    def _run(self, items: list, params: list) -> list:
        engine = self.engine
        ids = []
        try:
            for item, sp in zip(items, params):
                ids.append(engine.add_request(None, item, sp))
        except Exception:
            engine.abort_request(ids)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        while any(r is None for r in results):
            for out in engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
        return results
