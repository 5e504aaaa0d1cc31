"""The scheduler (vLLM v1 contract): no prefill or decode phase. Each step spends a token budget so
that every request's computed tokens catch up with its known tokens. Running requests go first,
then waiting ones; a long prefill is chunked; preemption is by recompute. No torch here (rule 3):
the output holds requests and counts, never tensors.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from appliance.engine.kv_cache_manager import KVCacheManager
from appliance.engine.request import Request, RequestStatus
from appliance.engine.step_cost import StepCostModel


@dataclass
class SchedulerOutput:
    # (request, number of tokens to compute this step), in batch order
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int = 0,
        itl_target: float | str | None = None,
    ):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # While decodes run, a step's prefill tokens are capped so the step stays within this many
        # seconds ("auto": a multiple of the decode-only step; None: no cap), from the measured cost.
        self.itl_target = itl_target
        self.step_cost = StepCostModel()
        self.num_capped_steps = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is and free its blocks. Idempotent."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        self.kv.free(req)
        return req

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------------
    def _chunk(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        if self.long_prefill_token_threshold and n > self.long_prefill_token_threshold:
            n = self.long_prefill_token_threshold
        return min(n, budget)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute-style preemption: free the blocks, keep the tokens (prompt and output so far),
        and put the request at the front of the queue."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.spec_num_computed = 0  # the draft model's KV went with the blocks
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        for req in self.running:  # blocks out of every window go back first, for this step to use
            self.kv.free_out_of_window(req)

        num_decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        prefill_left = self.step_cost.prefill_cap(num_decodes, self.itl_target)
        capped = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            prefill = req.num_tokens - req.num_computed_tokens > 1
            if prefill and prefill_left is not None and n > prefill_left:
                n, capped = prefill_left, True
            if n <= 0:
                i += 1
                continue
            if req.spec_token_ids:
                # a decode with drafts: its last token plus as many drafts as the budget and the
                # context allow (positions up to num_tokens - 1 + drafts must stay < max_model_len)
                num_spec = 0 if prefill else min(len(req.spec_token_ids), budget - n,
                                                 self.max_model_len - req.num_tokens)
                req.spec_token_ids = req.spec_token_ids[:max(num_spec, 0)]
                n += len(req.spec_token_ids)
            while not self.kv.allocate_slots(req, n):
                if req.spec_token_ids:  # drafts are optional: drop them before preempting anyone
                    n -= len(req.spec_token_ids)
                    req.spec_token_ids = []
                    continue
                victim = self.running.pop()  # the lowest priority: the most recently admitted
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, n))
                scheduled_ids.add(req.request_id)
                budget -= n
                if prefill and prefill_left is not None:
                    prefill_left -= n
                i += 1
                continue
            break  # req itself was preempted; nothing after it is left in running

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                # Prompt logprobs need every prompt position computed, so such requests skip the cache.
                use_cache = (req.num_computed_tokens == 0 and req.sampling_params.prompt_logprobs is None
                             and req.use_prefix_cache)
                blocks, hashes = self.kv.get_computed_blocks(req) if use_cache else ([], [])
                num_hit = len(blocks) * self.kv.block_size
                n = req.num_tokens - req.num_computed_tokens - num_hit
                if self.long_prefill_token_threshold and n > self.long_prefill_token_threshold:
                    n = self.long_prefill_token_threshold
                n = min(n, budget)
                if prefill_left is not None and n > prefill_left:
                    n, capped = prefill_left, True
                if n <= 0 or not self.kv.allocate_slots(req, n, blocks, hashes):
                    break
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                    req.scheduled_time = time.monotonic()
                self.waiting.popleft()
                req.spec_token_ids = []  # an admitted request prefills first: no drafts this step
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append((req, n))
                budget -= n
                if prefill_left is not None:
                    prefill_left -= n

        self.num_capped_steps += capped
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def update_computed(self, out: SchedulerOutput) -> list[Request]:
        """Advance computed counts after the forward pass. Returns the requests that now have all
        their known tokens computed, i.e. that sampled a token this step (in batch order)."""
        sampled = []
        for req, n in out.scheduled:
            # the drafts' positions count once verified (LLMEngine._append_run), not here
            req.num_computed_tokens += n - len(req.spec_token_ids)
            if req.num_computed_tokens == req.num_tokens:
                sampled.append(req)
        return sampled

    def check(self) -> None:
        """Block pool integrity against every live request's block table (called by tests)."""
        self.kv.pool.check(r.block_ids for r in self.requests.values())
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, r
            assert len(r.block_ids) * self.kv.block_size >= r.num_computed_tokens, r
