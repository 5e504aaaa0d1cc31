"""The offline API, mirroring vLLM's: ``LLM(model=...).generate(prompts, params)`` and ``.chat``."""
from __future__ import annotations

from collections.abc import Sequence

from appliance.config import EngineConfig
from appliance.engine.llm_engine import EmbeddingRequestOutput, LLMEngine, RequestOutput
from appliance.errors import InvalidRequestError
from appliance.generation_defaults import load_generation_defaults
from appliance.pooling_params import PoolingParams
from appliance.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, generation_config: str = "auto", **engine_kwargs):
        """``generation_config``: ``auto`` (vLLM's default) takes default sampling parameters from
        the model (see ``get_default_sampling_params``); ``vllm`` ignores them."""
        if generation_config not in ("auto", "vllm"):
            raise InvalidRequestError(f"generation_config must be 'auto' or 'vllm', got {generation_config!r}",
                                      "generation_config")
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_kwargs))
        self.default_sampling: dict = (load_generation_defaults(self.engine.model_path)
                                       if generation_config == "auto" else {})

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation defaults (vLLM's method): what ``generate``
        and ``chat`` use when given no sampling params. Explicit SamplingParams are used as they are."""
        return SamplingParams(**self.default_sampling)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. A prompt is a string,
        a list of token ids, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` (vLLM's forms);
        ``prompts`` is one of them or a list mixing them. All prompts are validated before any is
        queued. No ``sampling_params``: ``get_default_sampling_params()``."""
        if prompt_token_ids is not None:
            items = [list(p) for p in prompt_token_ids]
        else:
            items = prompt_items(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or self.get_default_sampling_params()] * len(items)
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
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of message dicts) or a list of them, as vLLM's ``LLM.chat``;
        ``tools`` and ``chat_template_kwargs`` go to the chat template."""
        conversations = conversation_items(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, continue_final_message=continue_final_message,
                                            tools=tools, chat_template_kwargs=chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompt_token_ids=prompts, sampling_params=sampling_params)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        tok = self.engine.tokenizer
        kw = dict(chat_template_kwargs or {})
        if tools is not None:
            kw["tools"] = tools
        if continue_final_message:
            kw["continue_final_message"] = True
        text = tok.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=add_generation_prompt and not continue_final_message, **kw)
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


def _is_token_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _one_prompt(p, where: str):
    """A prompt in one of vLLM's forms -> what LLMEngine.add_request takes (a string or token ids)."""
    if isinstance(p, str):
        return p
    if _is_token_ids(p):
        return list(p)
    if isinstance(p, dict):
        keys = set(p)
        if keys == {"prompt"} and isinstance(p["prompt"], str):
            return p["prompt"]
        if keys == {"prompt_token_ids"} and _is_token_ids(p["prompt_token_ids"]):
            return list(p["prompt_token_ids"])
        extra = sorted(keys - {"prompt", "prompt_token_ids"})
        raise InvalidRequestError(
            f"{where}: a prompt dict must be {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}; got keys "
            f"{sorted(keys)}" + (f" ({', '.join(extra)} not supported)" if extra else ""), "prompts")
    raise InvalidRequestError(f"{where}: a prompt must be a string, a list of token ids, {{'prompt': str}} or "
                              f"{{'prompt_token_ids': [...]}}; got {type(p).__name__}", "prompts")


def prompt_items(prompts) -> list:
    """vLLM's prompt forms (a string, {"prompt": str}, {"prompt_token_ids": [...]}, a list of token
    ids, or a list mixing them) as a list of strings and token-id lists."""
    if prompts is None:
        return []
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [_one_prompt(prompts, "prompts")]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(f"prompts: expected a string, a prompt dict or a list of prompts, got "
                                  f"{type(prompts).__name__}", "prompts")
    return [_one_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def conversation_items(messages) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of conversations -> a list of them."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError(f"messages: expected a non-empty list of message dicts or of conversations, got "
                                  f"{type(messages).__name__ if messages else messages!r}", "messages")
    if all(isinstance(m, dict) for m in messages):
        return [list(messages)]
    out = []
    for i, conv in enumerate(messages):
        if not isinstance(conv, (list, tuple)) or not conv:
            raise InvalidRequestError(f"messages[{i}]: expected a conversation (a non-empty list of message dicts), "
                                      f"got {type(conv).__name__}", "messages")
        for j, m in enumerate(conv):
            if not isinstance(m, dict):
                raise InvalidRequestError(f"messages[{i}][{j}]: expected a message dict, got {type(m).__name__}",
                                          "messages")
        out.append(list(conv))
    return out
