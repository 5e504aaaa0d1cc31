"""Speculative decoding (``--speculative-config``): proposers, the per-step policy, verification.

One step of a speculating request (the engine drives it):
1. ``before_schedule``: a running decode gets drafts (n-gram: the tokens; draft model: placeholders,
   as the scheduler needs only their count) unless speculation is off for this step (more running
   requests than ``disable_by_batch_size``) or paused for the request (low acceptance rate); then
   ``policy.DraftLengthPolicy`` keeps the first and as many more as pay for their share of the step.
2. The scheduler gives it 1 + k tokens (its last token and the drafts, fewer when the budget or the
   context is short), a small chunk for the chunked-prefill attention; slots for the drafts come
   from the pool, but only known tokens are hashed into the prefix cache.
3. ``after_schedule``: the draft model fills in its tokens (batched, k forwards of the small model).
4. The runner returns logits at the last token and at every draft; ``verify`` turns them into the
   emitted tokens (greedy match or rejection sampling on the processed target distributions).
5. The engine appends them one at a time with the usual stop checks, counts the accepted drafts as
   computed, releases blocks that held only rejected drafts, and ``record`` updates the statistics;
   ``observe_step`` gives the policy the forward time of each decode-only step.
"""
from __future__ import annotations

import logging

import torch

from appliance.config import EngineConfig, parse_speculative_config
from appliance.engine.request import Request
from appliance.engine.sampler import SampleResult, top_logprobs
from appliance.engine.spec_decode.ngram import propose_ngram
from appliance.engine.spec_decode.policy import DraftLengthPolicy
from appliance.engine.spec_decode.rejection import greedy_accept, rejection_sample

log = logging.getLogger("appliance")

# Running acceptance rate: an exponential moving average over a request's speculative steps. Below
# min_acceptance_rate, the request decodes without drafts for PAUSE_STEPS steps, then tries again
# from RESUME_RATE (a couple of bad steps pause it again). Each pause that follows another without a
# good step between (at least half the drafts accepted) is twice as long, up to MAX_PAUSE_STEPS: on
# open-ended text, retrying every 16 steps cost ~6% of decode speed at 0.07 acceptance.
EMA_WEIGHT = 0.3
PAUSE_STEPS = 16
MAX_PAUSE_STEPS = 256
RESUME_RATE = 0.5


def next_draft_length(current: int, k: int, num_drafts: int, num_accepted: int) -> int:
    """A request's draft length for its next speculating step, from the one just verified: all
    drafts accepted, one more than were proposed (up to ``k``), since the text it follows goes on;
    a draft rejected at position ``a``, ``a + 1``: the run it followed ended there, and the next
    step tries one past it. Drafts that turn out wrong then cost a short verify chunk, while a
    request that keeps copying its input grows back to ``k`` by one token per step."""
    if num_accepted >= num_drafts:
        return min(k, max(current, num_drafts) + 1)
    return min(k, num_accepted + 1)


class _Ahead:
    """A request as seen from a later verification position: its earlier drafts appended, so that
    penalties and min_tokens apply to the target distribution at that position as they would have
    without speculation."""

    __slots__ = ("request_id", "sampling_params", "eos_token_ids", "prompt_token_ids", "all_token_ids")

    def __init__(self, req: Request, drafts: list[int]):
        self.request_id = req.request_id
        self.sampling_params = req.sampling_params
        self.eos_token_ids = req.eos_token_ids
        self.prompt_token_ids = req.prompt_token_ids
        self.all_token_ids = req.all_token_ids + drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)


def _position_dependent(req: Request) -> bool:
    sp = req.sampling_params
    return (sp.repetition_penalty != 1.0 or bool(sp.presence_penalty) or bool(sp.frequency_penalty)
            or sp.min_tokens > 0)


class SpecDecoder:
    def __init__(self, config: EngineConfig, engine):
        self.config = parse_speculative_config(config.speculative_config)
        self.k = self.config.num_speculative_tokens
        self.draft = None
        if self.config.method == "draft_model":
            from appliance.engine.spec_decode.draft import DraftModelProposer

            self.draft = DraftModelProposer(config, self.config, engine.runner, engine.tokenizer,
                                            engine.max_model_len)
        # vLLM's counters: speculating request-steps, draft tokens proposed, draft tokens accepted,
        # and accepted tokens per draft position
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_per_pos = [0] * self.k
        self.num_steps_off = 0  # steps with speculation off for the batch size
        self.policy = DraftLengthPolicy()
        log.info("speculative decoding: %s", self.config)

    def describe(self) -> str:
        """One line for the server's start-up table."""
        c = self.config
        how = (f"n-gram lookup {c.prompt_lookup_min}..{c.prompt_lookup_max}" if c.method == "ngram"
               else f"draft model {c.model}")
        return (f"{how}, k={c.num_speculative_tokens}{' (fewer where they do not pay)' if c.cost_aware else ''}; "
                f"off above {c.disable_by_batch_size} running requests, "
                f"paused per request below acceptance {c.min_acceptance_rate}")

    def stats(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_per_pos),
                "spec_decode_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
                if self.num_draft_tokens else 0.0,
                # tokens per speculating step: the accepted drafts and the target's own token
                "spec_decode_mean_accepted_length": 1 + self.num_accepted_tokens / self.num_drafts
                if self.num_drafts else 0.0,
                # proposed drafts left out because their expected gain was below their cost
                "spec_decode_num_trimmed_tokens": self.policy.num_trimmed}

    # -- proposing ----------------------------------------------------------------------------
    def before_schedule(self, running: list[Request]) -> None:
        for r in running:
            r.spec_token_ids = []
        if len(running) > self.config.disable_by_batch_size:
            self.num_steps_off += 1  # a large batch: decode is compute-bound, drafts would cost time
            return
        cfg = self.config
        proposed = []
        for r in running:
            if not r.spec_allowed or r.num_tokens - r.num_computed_tokens != 1:
                continue  # prefilling, or never speculating
            if r.spec_paused_steps > 0:
                r.spec_paused_steps -= 1
                continue
            # a verified step emits up to k + 1 tokens: no drafts past max_tokens; the request's own
            # draft length (adaptive, see record) when it has one
            k = min(r.spec_k or self.k, r.max_tokens - r.num_output_tokens - 1)
            if k < 1:
                continue
            if self.draft is None:
                r.spec_token_ids = propose_ngram(r.all_token_ids, cfg.prompt_lookup_min, cfg.prompt_lookup_max, k)
            else:
                r.spec_token_ids = [-1] * k  # the draft model fills them in after scheduling
            if r.spec_token_ids:
                proposed.append(r)
        if not cfg.cost_aware or not proposed or any(r.num_tokens - r.num_computed_tokens != 1 for r in running):
            return  # nothing to trim; or a prompt in the step, whose size then is not a decode step's
        keep = self.policy.choose(len(running), [self.policy.alpha(r) for r in proposed],
                                  [len(r.spec_token_ids) for r in proposed], self.draft is not None)
        if keep is None:
            return  # no decode step timed yet: verify every proposal
        for r, n in zip(proposed, keep):
            r.spec_token_ids = r.spec_token_ids[:n]

    def after_schedule(self, scheduled, sampler) -> None:
        if self.draft is None:
            return
        reqs = [r for r, _ in scheduled if r.spec_token_ids]
        if reqs:
            self.draft.propose(reqs, sampler)
            for seconds in self.draft.forward_seconds:
                self.policy.observe_draft(seconds)

    def observe_step(self, scheduled, seconds: float) -> None:
        """The target's forward time for a step (before ``update_computed``): the policy learns
        from decode-only steps, a request's last token plus its drafts each."""
        if all(n == 1 + len(r.spec_token_ids) and r.num_tokens - r.num_computed_tokens == 1 for r, n in scheduled):
            self.policy.observe_step(sum(n for _, n in scheduled), seconds)

    # -- verifying ----------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, reqs: list[Request], sampler) -> list[list[SampleResult]]:
        """``logits``: raw float32 target logits, 1 + len(spec_token_ids) rows per request in order
        (the last known token's, then each draft's). Returns each request's emitted tokens with the
        target's logprobs (of its raw distribution, as without speculation)."""
        views, spans = [], []
        for r in reqs:
            s = len(r.spec_token_ids)
            spans.append((len(views), s))
            if _position_dependent(r):
                views.extend(_Ahead(r, r.spec_token_ids[:j]) for j in range(s + 1))
            else:
                views.extend([r] * (s + 1))
        processed = sampler.process(logits, views)
        raw_lp = (torch.log_softmax(logits, dim=-1)
                  if any(r.sampling_params.logprobs is not None for r in reqs) else None)
        greedy_rows = [i for i, v in enumerate(views) if v.sampling_params.greedy]
        argmax = {}
        if greedy_rows:
            argmax = dict(zip(greedy_rows, sampler.argmax(processed[greedy_rows]).tolist()))
        sampled_rows = [i for i, v in enumerate(views) if not v.sampling_params.greedy]
        probs = {}
        if sampled_rows:
            p = sampler.probs(processed[sampled_rows], [views[i] for i in sampled_rows])
            probs = {i: row for i, row in zip(sampled_rows, p)}
        out = []
        for r, (off, s) in zip(reqs, spans):
            drafts = r.spec_token_ids
            if r.sampling_params.greedy:
                tokens = greedy_accept([argmax[off + j] for j in range(s + 1)], drafts)
            else:
                q = self.draft.take_probs(r.request_id) if self.draft is not None else None
                p = torch.stack([probs[off + j] for j in range(s + 1)])
                tokens = rejection_sample(p, drafts, q, sampler.generator_for(r))
            k = r.sampling_params.logprobs
            res = []
            for j, t in enumerate(tokens):
                if k is None:
                    res.append(SampleResult(t, None, None))
                else:
                    d = top_logprobs(raw_lp[off + j], t, k)
                    res.append(SampleResult(t, d, d[t]))
            out.append(res)
        return out

    def record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Statistics and the request's running acceptance rate after one verified step."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.num_accepted_per_pos[j] += 1
        req.spec_acceptance = (1 - EMA_WEIGHT) * req.spec_acceptance + EMA_WEIGHT * num_accepted / num_drafts
        if req.spec_acceptance < self.config.min_acceptance_rate:
            req.spec_pause_len = min(MAX_PAUSE_STEPS, 2 * req.spec_pause_len) if req.spec_pause_len else PAUSE_STEPS
            req.spec_paused_steps = req.spec_pause_len
            req.spec_acceptance = RESUME_RATE
        elif 2 * num_accepted >= num_drafts:
            req.spec_pause_len = 0  # a good step: the next pause starts short again
        req.spec_k = next_draft_length(req.spec_k or self.k, self.k, num_drafts, num_accepted)
        self.policy.record(req, num_drafts, num_accepted)
        # the draft model's cache holds valid KV only up to the verified tokens
        req.spec_num_computed = min(req.spec_num_computed, req.num_computed_tokens)

    def forget(self, request_id: str) -> None:
        if self.draft is not None:
            self.draft.take_probs(request_id)
