"""The engine: requests in, one scheduler step at a time, outputs out.

``add_request`` validates and tokenizes; ``step`` schedules, runs the model, samples, appends tokens,
checks the token-level stop conditions and returns a ``RequestOutput`` for every request that changed.

With ``detokenize=True`` (the offline ``LLM``) each step's new tokens also go through a
``ChoiceText`` per sequence, here, right after the step; a stop string ends its sequence before the
next step. The server's engine core runs with ``detokenize=False``: outputs carry token ids only,
the frontend process detokenizes and matches stop strings, and stops a sequence with
``stop_sequences`` (the engine loop never waits on detokenization).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from appliance.config import EngineConfig
from appliance.engine.detokenizer import ChoiceText
from appliance.engine.device import resolve_device
from appliance.engine.step_cost import parse_itl_target
from appliance.engine.kv_cache_manager import KVCacheManager
from appliance.engine.model_runner import ModelRunner
from appliance.engine.request import FINISH_REASON, Request, RequestStatus
from appliance.engine.sampler import Sampler, top_logprobs
from appliance.engine.scheduler import Scheduler
from appliance.errors import InvalidRequestError, ModelLoadError
from appliance.pooling_params import PoolingParams
from appliance.sampling_params import SamplingParams, check_logit_bias_vocab
from appliance.structured.matchers import StructuredOutputs

log = logging.getLogger("appliance")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


@dataclass
class EmbeddingOutput:
    """The pooled vector of one prompt (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """A finished pooling request (vLLM's ``EmbeddingRequestOutput``): ``outputs.embedding``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    texts: list[ChoiceText] | None  # None: not detokenized here


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device is not None and device.type == "cuda":  # the host CPU's bf16 support says nothing here
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    from appliance.runtime.cpu_features import detect

    return torch.bfloat16 if detect().native_bf16 else torch.float32


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True):
        from appliance.engine.tokenizer import load_tokenizer
        from appliance.models.default_model import resolve_model_source, tokenizer_path
        from appliance.models.loader import model_info

        self.config = config
        self.detokenize = detokenize
        self.device = resolve_device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_path = resolve_model_source(config.model)  # a model directory or a GGUF file
        self.info = model_info(self.model_path)
        self.pooler_config = self._resolve_runner()  # None: a generate runner
        limit = self.info.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise InvalidRequestError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={limit} "
                f"({self.model_path if self.model_path.is_file() else self.model_path / 'config.json'})",
                "max_model_len")
        self.max_model_len = config.max_model_len or limit
        try:
            self.tokenizer = load_tokenizer(config.tokenizer or tokenizer_path(self.model_path),
                                            from_gguf=config.tokenizer is None and self.model_path.is_file())
        except Exception as e:  # tokenizers raise many types for missing/corrupt files
            raise ModelLoadError(f"{config.tokenizer or self.model_path}: cannot load tokenizer ({e})") from e
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.tensor_parallel_size > 1:  # rank 0 drives the other ranks; the rest of the engine is unchanged
            from appliance.distributed.executor import TPExecutor

            self.runner = TPExecutor(config, self.info, self.dtype, self.max_model_len, self.device,
                                     self.pooler_config)
        else:
            self.runner = ModelRunner(config, self.info, self.dtype, self.max_model_len, self.device,
                                      self.pooler_config)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                 self.runner.sliding_window)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.long_prefill_token_threshold,
                                   parse_itl_target(config.itl_target))
        self.sampler = Sampler(self.device, config.seed, argmax=self.runner.ops.argmax)
        self.spec = None  # speculative decoding (appliance/engine/spec_decode), when configured
        if config.speculative_config is not None:
            if self.pooler_config is not None:
                raise InvalidRequestError("speculative_config applies to runner=generate; this engine's runner is "
                                          "pooling", "speculative_config")
            from appliance.engine.spec_decode import SpecDecoder

            self.spec = SpecDecoder(config, self)
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = self.info.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self.eos_token_ids += self._turn_end_ids()
        # Grammar matchers of constrained sequences (llguidance is loaded on the first one).
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.parents: dict[str, _Parent] = {}
        # Seconds per part of ``step`` (forward_s: the model and logits; prepare_s: turning the
        # schedule into tensors; output_s: appending tokens, stop checks, detokenizing when this
        # engine does it, outputs).
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "schedule_s": 0.0,
                      "prepare_s": 0.0, "forward_s": 0.0, "sample_s": 0.0, "output_s": 0.0, "step_s": 0.0}
        self._next_id = 0

    @property
    def runner_type(self) -> str:
        return "generate" if self.pooler_config is None else "pooling"

    def _resolve_runner(self):
        """``config.runner`` against the checkpoint's architecture (vLLM's --runner). For pooling: the
        architecture becomes its pooling form (``registry.pooling_architecture``) and the pooler
        config is resolved; returns it. For generate: None."""
        import dataclasses

        from appliance.layers.pooler import resolve_pooler_config
        from appliance.models.registry import is_pooling_architecture, pooling_architecture

        arch, runner = self.info.architecture, self.config.runner
        if runner == "auto":
            runner = "pooling" if is_pooling_architecture(arch) else "generate"
        if runner == "generate":
            if is_pooling_architecture(arch):
                raise ModelLoadError(f"{self.model_path}: architecture {arch} is a pooling model (no lm_head); "
                                     f"runner=generate cannot generate with it (use runner=pooling)")
            if self.config.pooler_config is not None:
                raise InvalidRequestError("pooler_config applies to runner=pooling only; this engine's runner is "
                                          "generate", "pooler_config")
            return None
        pooled = pooling_architecture(arch)
        if pooled is None:
            raise ModelLoadError(f"{self.model_path}: architecture {arch} has no pooling form; runner=pooling "
                                 f"supports the Llama-family decoders (LlamaModel, MistralModel, Qwen2Model, "
                                 f"Qwen3Model and their *ForCausalLM)")
        self.info = dataclasses.replace(self.info, architecture=pooled)
        # a GGUF file carries no sentence-transformers modules: only --pooler-config and the defaults
        return resolve_pooler_config(self.model_path if self.model_path.is_dir() else None, self.config.pooler_config)

    def _turn_end_ids(self) -> tuple[int, ...]:
        """The ids of the family's end-of-turn tokens this tokenizer has (``registry.turn_end_tokens``)
        that are not stop ids already."""
        from appliance.models.registry import turn_end_tokens

        tok, out = self.tokenizer, []
        for text in turn_end_tokens(self.info.architecture):
            tid = tok.convert_tokens_to_ids(text)
            if tid is None or (tid == tok.unk_token_id and text != tok.unk_token):  # not in this vocabulary
                continue
            if tid not in self.eos_token_ids and tid not in out:
                out.append(int(tid))
        return tuple(out)

    # -- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    @property
    def max_chunk_tokens(self) -> int:
        """The most new tokens one step gives one request (the step budget, or the per-request cap)."""
        c = self.config
        return min(c.max_num_batched_tokens, c.long_prefill_token_threshold or c.max_num_batched_tokens)

    def add_request(self, request_id: str | None, prompt: str | list[int] | None,
                    params: SamplingParams | PoolingParams | None = None) -> str:
        """Validate, tokenize and queue a request. Raises InvalidRequestError (nothing is queued).
        A pooling runner takes PoolingParams (None: the defaults), a generate runner SamplingParams."""
        if self.pooler_config is not None or isinstance(params, PoolingParams):
            return self._add_pooling_request(request_id, prompt, params)
        params = params or SamplingParams()
        if request_id is None:
            request_id = self.new_request_id()
        if request_id in self.parents:
            raise InvalidRequestError(f"request_id {request_id!r} is already in flight", "request_id")
        text, ids = self._prompt_ids(prompt)
        n_prompt = len(ids)
        if n_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {n_prompt} tokens; this model's context (max_model_len) is {self.max_model_len} "
                f"tokens, leaving no room to generate", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"max_tokens={max_tokens} plus the prompt's {n_prompt} tokens is {n_prompt + max_tokens}, "
                f"beyond max_model_len={self.max_model_len}", "max_tokens")
        # A windowed model's request holds only its window's blocks (plus one step's chunk) at a time.
        need = self.kv.max_blocks_held(n_prompt + max_tokens, self.max_chunk_tokens)
        if need > self.kv.num_blocks:
            raise InvalidRequestError(
                f"prompt ({n_prompt}) + max_tokens ({max_tokens}) needs {need} KV blocks of "
                f"{self.config.block_size} tokens at once; the whole KV cache has {self.kv.num_blocks}",
                "max_tokens")
        check_logit_bias_vocab(params.logit_bias, self.vocab_size)
        # Compiled before anything is queued: a bad grammar leaves no trace.
        compiled = self.structured.compile(params.structured_outputs) if params.structured_outputs else None
        children = []
        for i in range(params.n):
            sp = params if params.n == 1 or params.seed is None else params.clone(seed=params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(rid, ids, sp, () if sp.ignore_eos else self.eos_token_ids, max_tokens,
                                    parent_id=request_id, index=i))
            if self.spec is not None and compiled is not None:
                # the grammar would have to advance through unverified drafts: this one decodes plainly
                children[-1].spec_allowed = False
                log.info("request %s: structured output, speculative decoding off for it", rid)
        texts = [ChoiceText(self.tokenizer, ids, c.sampling_params) for c in children] if self.detokenize else None
        self.parents[request_id] = _Parent(request_id, text, ids, children, texts)
        for c in children:
            if compiled is not None:
                self.structured.add(c.request_id, compiled)  # each sequence its own matcher (n > 1 too)
            self.scheduler.add_request(c)
        return request_id

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenize(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}", "prompt")
        else:
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                      "prompt")
        if not ids:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        return text, ids

    def _add_pooling_request(self, request_id: str | None, prompt, params: PoolingParams | None) -> str:
        if self.pooler_config is None:
            raise InvalidRequestError("this engine's runner is generate; pooling requests (PoolingParams) need "
                                      "runner=pooling", "runner")
        if params is None:
            params = PoolingParams()
        elif not isinstance(params, PoolingParams):
            raise InvalidRequestError(f"this engine's runner is pooling: it embeds prompts (PoolingParams) and cannot "
                                      f"generate; got {type(params).__name__}", "runner")
        if request_id is None:
            request_id = self.new_request_id()
        if request_id in self.parents:
            raise InvalidRequestError(f"request_id {request_id!r} is already in flight", "request_id")
        text, ids = self._prompt_ids(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]  # vLLM keeps the last k tokens
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(f"prompt is {len(ids)} tokens; this model's max_model_len is "
                                      f"{self.max_model_len}", "prompt")
        need = self.kv.max_blocks_held(len(ids), self.max_chunk_tokens)  # the same bound as generation's
        if need > self.kv.num_blocks:
            raise InvalidRequestError(f"prompt ({len(ids)} tokens) needs {need} KV blocks of {self.config.block_size} "
                                      f"tokens at once; the whole KV cache has {self.kv.num_blocks}", "prompt")
        hidden = self.runner.model.config.hidden_size
        if params.dimensions is not None and params.dimensions > hidden:
            raise InvalidRequestError(f"dimensions={params.dimensions} exceeds the model's hidden size {hidden}",
                                      "dimensions")
        req = Request(request_id, ids, SamplingParams(max_tokens=1), (), 0, pooling_params=params)
        req.use_prefix_cache = not self.pooler_config.needs_every_position
        self.parents[request_id] = _Parent(request_id, text, ids, [req], None)
        self.scheduler.add_request(req)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            for c in parent.children:
                if not c.is_finished:
                    self.scheduler.finish_request(c.request_id, RequestStatus.FINISHED_ABORTED)
                self.sampler.forget(c.request_id)
                if self.spec is not None:
                    self.spec.forget(c.request_id)
                if self.runner.pooler is not None:
                    self.runner.pooler.forget(c.request_id)
                self.structured.forget(c.request_id)

    def stop_sequences(self, request_id: str, indices: list[int], stop_reason: str | None = None) -> bool:
        """End some sequences of a request as stopped (a stop string matched outside the engine):
        their blocks are freed and they get no further output. When none of the request's
        sequences is left running, the request is dropped without a final output (whoever stopped
        them already knows) and True is returned."""
        parent = self.parents.get(request_id)
        if parent is None:
            return False
        for i in indices:
            c = parent.children[i]
            if not c.is_finished:
                c.stop_reason = stop_reason
                self.scheduler.finish_request(c.request_id, RequestStatus.FINISHED_STOPPED)
                self.sampler.forget(c.request_id)
                self.structured.forget(c.request_id)
        if all(c.is_finished for c in parent.children):
            del self.parents[request_id]
            return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self.spec is not None:
            self.spec.before_schedule(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        if self.pooler_config is not None:
            return self._step_pooling(sched, t0)
        if self.spec is not None:
            self.spec.after_schedule(sched.scheduled, self.sampler)  # the draft model's tokens
        plp_rows = [i for i, (r, _) in enumerate(sched.scheduled)
                    if r.prompt_logprobs is not None and r.num_computed_tokens < r.num_prompt_tokens]
        masks = None
        if self.structured.active:
            # The sequences that sample this step (as update_computed will return them, in order):
            # their grammar masks are computed on a worker thread while the forward pass below runs
            # (llguidance releases the GIL, so does torch in its kernels); joined before sampling.
            # Speculating requests (never constrained ones) are not among them: 1 + drafts tokens.
            will_sample = [r.request_id for r, n in sched.scheduled if r.num_computed_tokens + n == r.num_tokens]
            masks = self.structured.start_masks(will_sample)
        t1 = time.perf_counter()
        logits, plp = self.runner.execute(sched, plp_rows)
        t2 = time.perf_counter()
        self.scheduler.step_cost.observe(sched.num_batched_tokens, t2 - t1)
        if self.spec is not None:
            self.spec.observe_step(sched.scheduled, t2 - t1)
        for i in plp_rows:
            self._record_prompt_logprobs(*sched.scheduled[i], plp[i])
        self.stats["prompt_tokens"] += sum(max(0, min(r.num_computed_tokens + n, r.num_prompt_tokens)
                                               - r.num_computed_tokens) for r, n in sched.scheduled)
        sampled = self.scheduler.update_computed(sched)
        touched: dict[str, _Parent] = {}
        t3 = time.perf_counter()
        num_generated = len(sampled)
        if sampled:
            plain, plain_rows, spec_reqs, spec_rows = sampled, None, [], []
            if any(r.spec_token_ids for r in sampled):  # logits rows: 1 + drafts per request, in order
                plain, plain_rows, row = [], [], 0
                for r in sampled:
                    m = 1 + len(r.spec_token_ids)
                    if m == 1:
                        plain.append(r)
                        plain_rows.append(row)
                    else:
                        spec_reqs.append(r)
                        spec_rows.extend(range(row, row + m))
                    row += m
            if masks is not None and [r.request_id for r in plain] != will_sample:
                raise RuntimeError("grammar masks were computed for other rows than the sampler's")
            results = {}
            if plain:
                rows = logits if plain_rows is None else logits[plain_rows]
                for r, res in zip(plain, self.sampler(rows, plain, masks.result() if masks is not None else None)):
                    results[r.request_id] = [res]
            if spec_reqs:
                for r, run in zip(spec_reqs, self.spec.verify(logits[spec_rows], spec_reqs, self.sampler)):
                    results[r.request_id] = run
            t3 = time.perf_counter()
            now = time.monotonic()
            for req in sampled:
                run = results[req.request_id]
                if len(run) == 1 and not req.spec_token_ids:
                    self._append(req, run[0], now)
                else:
                    num_generated += self._append_run(req, run, now) - 1
                touched[req.parent_id] = self.parents[req.parent_id]
        outputs = [self._output(p) for p in touched.values()]
        for o in outputs:
            if o.finished:
                del self.parents[o.request_id]
        self.stats["steps"] += 1
        self.stats["generation_tokens"] += num_generated
        st = self.stats
        prep = self.runner.last_prepare_s
        st["schedule_s"] += t1 - t0
        st["prepare_s"] += prep
        st["forward_s"] += t2 - t1 - prep
        st["sample_s"] += t3 - t2
        t4 = time.perf_counter()
        st["output_s"] += t4 - t3
        st["step_s"] += t4 - t0
        return outputs

    def _step_pooling(self, sched, t0: float) -> list[EmbeddingRequestOutput]:
        """A pooling runner's step: prompt chunks through the model, the pooler, and every request
        whose prompt is now computed finishes with its vector (its KV blocks freed)."""
        t1 = time.perf_counter()
        pooled = self.runner.execute_pooling(sched)
        t2 = time.perf_counter()
        self.stats["prompt_tokens"] += sum(n for _, n in sched.scheduled)
        outputs = []
        for req in self.scheduler.update_computed(sched):
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            p = self.parents.pop(req.parent_id)
            outputs.append(EmbeddingRequestOutput(req.parent_id, p.prompt, p.prompt_token_ids,
                                                  EmbeddingOutput(pooled[req.request_id]),
                                                  num_cached_tokens=max(req.num_cached_tokens, 0)))
        st = self.stats
        prep = self.runner.last_prepare_s
        st["steps"] += 1
        st["schedule_s"] += t1 - t0
        st["prepare_s"] += prep
        st["forward_s"] += t2 - t1 - prep
        t3 = time.perf_counter()
        st["output_s"] += t3 - t2
        st["step_s"] += t3 - t0
        return outputs

    def _record_prompt_logprobs(self, req: Request, n: int, lp: torch.Tensor) -> None:
        start = req.num_computed_tokens  # before this step's update
        k = req.sampling_params.prompt_logprobs
        for j in range(n):
            nxt = start + j + 1  # the token position whose logprob row j predicts
            if nxt >= req.num_prompt_tokens or nxt < len(req.prompt_logprobs):
                continue  # past the prompt, or already recorded before a preemption
            req.prompt_logprobs.append(top_logprobs(lp[j], req.all_token_ids[nxt], k))

    def _append_run(self, req: Request, run: list, now: float) -> int:
        """Append a speculating request's verified tokens (its accepted drafts, then the target's
        token) one at a time with every stop check: a stop inside the run drops the rest. Each
        accepted draft's KV was computed this step, so it counts as computed; blocks that held only
        rejected drafts go back to the pool. Returns how many tokens were appended."""
        num_drafts = len(req.spec_token_ids)
        req.spec_token_ids = []
        appended = 0
        for j, res in enumerate(run):
            self._append(req, res, now)
            appended += 1
            if req.is_finished:
                break
            if j < len(run) - 1:
                req.num_computed_tokens += 1
        if not req.is_finished:
            self.kv.free_tail(req, req.num_tokens)
        self.spec.record(req, num_drafts, len(run) - 1)
        return appended

    def _append(self, req: Request, res, now: float) -> None:
        tok = res.token_id
        req.append_token(tok)
        if req.first_token_time is None:
            req.first_token_time = now
        if req.logprobs is not None:
            req.logprobs.append(res.logprobs)
            req.cumulative_logprob += res.sampled_logprob
        sp = req.sampling_params
        status = None
        if self.structured.advance(req.request_id, tok):  # the grammar is complete
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif req.num_output_tokens >= sp.min_tokens:
            if tok in req.eos_token_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
            elif tok in sp.stop_token_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
        if status is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        texts = self.parents[req.parent_id].texts
        if texts is not None:
            ct = texts[req.index]
            ct.update([tok], FINISH_REASON.get(status), req.stop_reason)
            if ct.finished and ct.finish_reason == "stop" and status != RequestStatus.FINISHED_STOPPED:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, ct.stop_reason  # a stop string
        if status is not None:
            self.scheduler.finish_request(req.request_id, status)
            self.sampler.forget(req.request_id)
            self.structured.forget(req.request_id)
            if self.spec is not None:
                self.spec.forget(req.request_id)

    def _output(self, p: _Parent) -> RequestOutput:
        outs = []
        for req in p.children:
            outs.append(CompletionOutput(
                index=req.index, text=p.texts[req.index].text if p.texts is not None else "",
                token_ids=req.output_token_ids,
                cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                logprobs=list(req.logprobs) if req.logprobs is not None else None,
                finish_reason=FINISH_REASON.get(req.status), stop_reason=req.stop_reason))
        first = p.children[0]
        return RequestOutput(
            request_id=p.request_id, prompt=p.prompt, prompt_token_ids=p.prompt_token_ids, outputs=outs,
            finished=all(o.finished for o in outs), prompt_logprobs=first.prompt_logprobs,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics={"arrival_time": first.arrival_time, "first_token_time": first.first_token_time,
                     "scheduled_time": first.scheduled_time})

    # -- introspection -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.scheduler.check()

    def kv_cache_usage(self) -> float:
        return self.kv.pool.usage
