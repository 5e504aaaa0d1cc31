"""The draft-model proposer: a second, small model of the same tokenizer with its own KV cache.

The draft's cache has as many blocks as the target's and is indexed by the target's block table,
so the block pool needs to know nothing about it. ``Request.spec_num_computed`` counts the
positions of a request the draft's cache holds: a first proposal computes the whole sequence (a
prefill of the small model), later ones only what the target accepted since (one or two tokens).
Positions past the verified tokens are cut back after each verification, and preemption resets the
count (its blocks are gone), so stale draft KV is never read.
"""
from __future__ import annotations

import logging
import time

import torch

from appliance.config import EngineConfig, SpeculativeConfig
from appliance.engine.request import Request
from appliance.engine.scheduler import SchedulerOutput
from appliance.errors import InvalidRequestError, ModelLoadError

log = logging.getLogger("appliance")


class _DraftSeq:
    """What ``ModelRunner._inputs`` reads of a request, for one draft forward: the tokens (known
    ones, then the drafts so far), where the draft's cache stands, and the request's block table."""

    __slots__ = ("all_token_ids", "num_computed_tokens", "block_ids")

    def __init__(self, token_ids: list[int], num_computed: int, block_ids: list[int]):
        self.all_token_ids = token_ids
        self.num_computed_tokens = num_computed
        self.block_ids = block_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, target_runner, tokenizer,
                 max_model_len: int):
        from transformers import AutoTokenizer

        from appliance.engine.model_runner import ModelRunner
        from appliance.models.default_model import resolve_model_source, tokenizer_path
        from appliance.models.loader import model_info

        field = "speculative_config.model"
        try:
            path = resolve_model_source(spec.model)
        except (ModelLoadError, OSError) as e:
            raise ModelLoadError(f"{field}={spec.model!r}: {e}") from e
        if not path.exists():
            raise ModelLoadError(f"{field}={spec.model!r}: no such model directory or GGUF file")
        if target_runner.sliding_window is not None:
            raise ModelLoadError(f"{field}={spec.model!r}: a draft model needs a target whose attention reads the "
                                 f"whole context; every layer of this target is windowed (sliding_window="
                                 f"{target_runner.sliding_window}), and the blocks it releases would be the draft's too")
        info = model_info(path)
        if info.max_position_embeddings < max_model_len:
            raise ModelLoadError(f"{field}={spec.model!r}: its max_position_embeddings={info.max_position_embeddings} "
                                 f"is below the target's max_model_len={max_model_len}")
        try:
            draft_tok = AutoTokenizer.from_pretrained(str(tokenizer_path(path)))
        except Exception as e:  # tokenizers raise many types for missing/corrupt files
            raise ModelLoadError(f"{field}={spec.model!r}: cannot load its tokenizer to check that it is the "
                                 f"target's ({e})") from e
        if draft_tok.get_vocab() != tokenizer.get_vocab():
            raise ModelLoadError(f"{field}={spec.model!r}: its tokenizer differs from the target's "
                                 f"({len(draft_tok.get_vocab())} vs {len(tokenizer.get_vocab())} tokens, or other ids); "
                                 f"a draft must share the target's tokenizer")
        quant = spec.quantization if spec.quantization is not None else config.quantization
        if quant == "gguf" and not (path.is_file() and path.suffix.lower() == ".gguf"):
            quant = "none"
        # the draft's proposals only decide how many tokens a step verifies, never which (--batch-invariant
        # is the target's: the draft keeps its fastest methods)
        draft_config = config.replace(model=str(path), num_kv_blocks=target_runner.num_blocks, quantization=quant,
                                      batch_invariant=False)
        try:
            self.runner = ModelRunner(draft_config, info, target_runner.dtype, max_model_len, target_runner.device)
        except InvalidRequestError as e:
            # --linear-backend names the target's method; a draft whose layers cannot run it (a float
            # method forced on the target, a quantized draft) has its layers chosen as under auto, said
            # in the log, rather than refusing a combination that is sound
            if e.param != "linear_backend" or config.linear_backend == "auto":
                raise
            log.warning("speculative decoding: the draft %s cannot run linear_backend=%s (%s); its layers are "
                        "chosen as under auto", path, config.linear_backend, e)
            self.runner = ModelRunner(draft_config.replace(linear_backend="auto"), info, target_runner.dtype,
                                      max_model_len, target_runner.device)
        if self.runner.vocab_size != target_runner.vocab_size:
            raise ModelLoadError(f"{field}={spec.model!r}: vocab_size={self.runner.vocab_size} differs from the "
                                 f"target's {target_runner.vocab_size}")
        if self.runner.block_size != target_runner.block_size:  # one config: cannot differ, but the cache relies on it
            raise ModelLoadError(f"{field}: block_size {self.runner.block_size} != {target_runner.block_size}")
        # the draft distributions of sampled requests, kept for rejection sampling: request id -> [k, vocab]
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.forward_seconds: list[float] = []  # the last propose's one-token forwards (the policy's draft cost)
        log.info("speculative decoding: draft model %s (%d layers), %d KV blocks shared by index with the target",
                 path, self.runner.num_layers, self.runner.num_blocks)

    def propose(self, reqs: list[Request], sampler) -> None:
        """Fill each request's ``spec_token_ids`` (placeholders whose count the scheduler fixed) with
        the draft's tokens, running the draft once per draft position for the whole batch. Greedy
        requests take the draft's argmax; sampled ones draw from the draft's distribution under their
        own temperature / top-k / top-p / min-p, which is kept for rejection sampling."""
        drafts = {r.request_id: [] for r in reqs}
        probs = {r.request_id: [] for r in reqs}
        num_steps = max(len(r.spec_token_ids) for r in reqs)
        # the seconds of each forward that fed one token per request (the cost of a draft position;
        # a first forward that also catches the draft's cache up is not one)
        self.forward_seconds = []
        for step in range(num_steps):
            active = [r for r in reqs if len(drafts[r.request_id]) < len(r.spec_token_ids)]
            seqs = []
            for r in active:
                toks = r.all_token_ids + drafts[r.request_id]
                # the first step catches the draft's cache up with the known tokens; later ones feed
                # the previous draft
                start = r.spec_num_computed if step == 0 else len(toks) - 1
                seqs.append((_DraftSeq(toks, start, r.block_ids), len(toks) - start))
            t = time.perf_counter()
            logits, _ = self.runner.execute(SchedulerOutput(seqs, sum(n for _, n in seqs)))
            if all(n == 1 for _, n in seqs):
                self.forward_seconds.append(time.perf_counter() - t)
            greedy = [i for i, r in enumerate(active) if r.sampling_params.greedy]
            sampled = [i for i, r in enumerate(active) if not r.sampling_params.greedy]
            choice = [0] * len(active)
            if greedy:
                for i, t in zip(greedy, sampler.argmax(logits[greedy]).tolist()):
                    choice[i] = t
            if sampled:
                p = sampler.probs(logits[sampled], [active[i] for i in sampled])
                p = p / p.sum(dim=-1, keepdim=True)
                for row, i in enumerate(sampled):
                    r = active[i]
                    choice[i] = int(torch.multinomial(p[row], 1, generator=sampler.generator_for(r)))
                    probs[r.request_id].append(p[row])
            for i, r in enumerate(active):
                drafts[r.request_id].append(choice[i])
                if step == 0:
                    r.spec_num_computed = r.num_tokens
                else:
                    r.spec_num_computed += 1
        for r in reqs:
            r.spec_token_ids = drafts[r.request_id]
            if probs[r.request_id]:
                self.draft_probs[r.request_id] = torch.stack(probs[r.request_id])

    def take_probs(self, request_id: str) -> torch.Tensor | None:
        return self.draft_probs.pop(request_id, None)
