"""A request owns its state (rule 2): token ids, computed count, block table, block hashes, status."""
from __future__ import annotations

import enum
import time

from appliance.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


# The one table mapping a finish status to OpenAI's finish_reason.
FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated. With ``n > 1`` the engine makes one Request per sample."""

    __slots__ = (
        "request_id", "parent_id", "index", "prompt_token_ids", "sampling_params", "eos_token_ids",
        "max_tokens", "all_token_ids", "num_computed_tokens", "block_ids", "block_hashes", "status",
        "stop_reason", "num_cached_tokens", "num_preemptions", "arrival_time", "first_token_time",
        "logprobs", "cumulative_logprob", "prompt_logprobs", "scheduled_time", "pooling_params",
        "use_prefix_cache", "spec_token_ids", "spec_num_computed", "spec_acceptance", "spec_paused_steps", "spec_pause_len",
        "spec_allowed", "spec_k", "spec_run_counts",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        max_tokens: int,
        parent_id: str | None = None,
        index: int = 0,
        pooling_params=None,
    ):
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens  # resolved: never None here
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # Hashes of this request's full blocks, in order; a prefix of ``block_ids``.
        self.block_hashes: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = -1  # prefix-cache hit length at first schedule; -1: not yet
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.scheduled_time: float | None = None  # first left the waiting queue (queue-time metric)
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )
        # a pooling request (PoolingParams): its prompt is computed, pooled and it finishes, no sampling
        self.pooling_params = pooling_params
        # False: prefix-cache hits would skip positions this request needs (MEAN / CLS pooling)
        self.use_prefix_cache = True
        # Speculative decoding (appliance/engine/spec_decode): the draft tokens scheduled after the
        # last token this step (never in all_token_ids until verified); how many positions the draft
        # model's own KV cache holds for this request; the running acceptance rate, and how many more
        # steps speculation stays paused for it after that rate fell too low.
        self.spec_token_ids: list[int] = []
        self.spec_num_computed = 0
        self.spec_acceptance = 1.0
        self.spec_paused_steps = 0
        self.spec_pause_len = 0  # the last pause's length (doubles while acceptance stays low)
        self.spec_allowed = True  # False: this request never speculates (e.g. structured output)
        self.spec_k = 0  # this request's current draft length (adaptive; 0: not speculated yet, use k)
        self.spec_run_counts = (0.0, 0.0)  # decayed accepted drafts and rejections (spec_decode/policy.py)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids})")
