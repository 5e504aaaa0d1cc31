"""Prometheus metrics in the text exposition format (0.0.4), written by hand: the frontend is one
process and the set is small, so ~100 lines beat a dependency. Names follow vLLM's with the
``appliance:`` prefix, so dashboards built for one map onto the other.

Request-level counters and latency histograms are measured in the frontend (what a client sees);
scheduler and KV-cache numbers are read from the engine core when ``/metrics`` is scraped.
"""
from __future__ import annotations

import bisect
import math

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
FINISH_REASONS = ("stop", "length", "abort")
# token-count histograms: 1-2-5 steps as vLLM's (it stops at max_model_len; these go past any)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(d: dict) -> str:
    if not d:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in d.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


def _engine_samples(name: str, key: str, labels: dict, engine: dict) -> list[str]:
    """The engine-side sample: the total, then (data parallel) one per replica labelled
    ``engine="<index>"`` as vLLM labels its engines."""
    out = [f"{name}{_labels(labels)} {_fmt(engine.get(key, 0))}"]
    for i, rep in enumerate(engine.get("replicas") or ()):
        out.append(f"{name}{_labels({**labels, 'engine': str(i)})} {_fmt(rep.get(key, 0))}")
    return out


def _emitter(out: list[str]):
    """metric(name, kind, help, samples): one metric's HELP and TYPE lines and its samples into ``out``."""
    def metric(name, kind, help_, samples):
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(samples)
    return metric


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, labels: dict) -> list[str]:
        out, acc = [], 0
        for bound, c in zip(self.bounds + (math.inf,), self.counts):
            acc += c
            out.append(f"{name}_bucket{_labels({**labels, 'le': _fmt(bound)})} {acc}")
        out.append(f"{name}_sum{_labels(labels)} {_fmt(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


class ServerMetrics:
    """Everything ``/metrics`` shows. Updated from the event loop only (no locks needed)."""

    def __init__(self, model_name: str):
        self.labels = {"model_name": model_name}
        self.runtime: dict = {}  # the engine process's runtime report (allocator, libgomp, OpenMP)
        self.requests = {r: 0 for r in FINISH_REASONS}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram()
        self.tpot = Histogram()  # per request: (e2e - ttft) / (output tokens - 1)
        self.itl = Histogram()  # every gap between two deltas of a stream
        self.e2e = Histogram()
        self.rejected = 0  # refused for capacity (--max-queued-requests) or shutdown
        # vLLM's per-request series (rendered under vllm: names only)
        self.queue = Histogram()  # arrival in the engine core -> first scheduled
        self.request_prompt_tokens = Histogram(TOKEN_BUCKETS)
        self.request_generation_tokens = Histogram(TOKEN_BUCKETS)

    def observe_request(self, num_prompt: int, num_output: int) -> None:
        """Once per finished request (all its sequences together), as vLLM counts them."""
        self.request_prompt_tokens.observe(num_prompt)
        self.request_generation_tokens.observe(num_output)

    def finish(self, reason: str, num_prompt: int, num_output: int, ttft: float | None, e2e: float) -> None:
        self.requests[reason if reason in self.requests else "stop"] += 1
        self.prompt_tokens += num_prompt
        self.generation_tokens += num_output
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_output > 1:
                self.tpot.observe((e2e - ttft) / (num_output - 1))
        self.e2e.observe(e2e)

    def render(self, engine: dict) -> str:
        L = self.labels
        out: list[str] = []
        metric = _emitter(out)

        metric("appliance:request_success_total", "counter", "Finished requests by finish reason.",
               [f"appliance:request_success_total{_labels({**L, 'finished_reason': r})} {n}"
                for r, n in self.requests.items()])
        metric("appliance:request_rejected_total", "counter",
               "Requests refused because the queue was full or the server was shutting down.",
               [f"appliance:request_rejected_total{_labels(L)} {self.rejected}"])
        metric("appliance:prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
               [f"appliance:prompt_tokens_total{_labels(L)} {self.prompt_tokens}"])
        metric("appliance:generation_tokens_total", "counter", "Generated tokens of finished requests.",
               [f"appliance:generation_tokens_total{_labels(L)} {self.generation_tokens}"])
        for name, h, help_ in (
            ("appliance:time_to_first_token_seconds", self.ttft, "Time to first token."),
            ("appliance:time_per_output_token_seconds", self.tpot, "Mean time per output token, per request."),
            ("appliance:inter_token_latency_seconds", self.itl, "Time between two streamed deltas."),
            ("appliance:e2e_request_latency_seconds", self.e2e, "End-to-end request latency."),
        ):
            metric(name, "histogram", help_, h.lines(name, L))
        gauges = (
            ("appliance:num_requests_running", "num_running", "Sequences in the running batch."),
            ("appliance:num_requests_waiting", "num_waiting", "Sequences waiting to be scheduled."),
            ("appliance:kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV cache blocks in use (0-1)."),
        )
        for name, key, help_ in gauges:
            metric(name, "gauge", help_, _engine_samples(name, key, L, engine))
        counters = (
            ("appliance:prefix_cache_queries_total", "prefix_cache_queries", "Prefix-cache lookups, in tokens."),
            ("appliance:prefix_cache_hits_total", "prefix_cache_hits", "Prefix-cache hits, in tokens."),
            ("appliance:num_preemptions_total", "num_preemptions", "Preemptions (KV cache full)."),
        )
        for name, key, help_ in counters:
            metric(name, "counter", help_, _engine_samples(name, key, L, engine))
        if engine.get("replicas"):
            metric("appliance:engine_requests_routed_total", "counter",
                   "Requests the frontend sent to each data-parallel replica.",
                   _engine_samples("appliance:engine_requests_routed_total", "num_requests_routed", L, engine)[1:])
        if "spec_decode_num_drafts" in engine:
            for name, key, help_ in (
                ("appliance:spec_decode_acceptance_rate", "spec_decode_acceptance_rate",
                 "Accepted draft tokens / proposed draft tokens (speculative decoding)."),
                ("appliance:spec_decode_mean_accepted_length", "spec_decode_mean_accepted_length",
                 "Tokens per speculating step: 1 + accepted drafts, averaged over steps."),
            ):
                metric(name, "gauge", help_, [f"{name}{_labels(L)} {_fmt(engine.get(key, 0))}"])
            name = "appliance:spec_decode_num_trimmed_tokens_total"
            metric(name, "counter", "Proposed draft tokens not verified: their expected gain was below their share "
                   "of the step's measured time.",
                   [f"{name}{_labels(L)} {_fmt(engine.get('spec_decode_num_trimmed_tokens', 0))}"])
        alloc = self.runtime.get("allocator")
        if alloc:
            live = "true" if alloc.get("name") == "mimalloc" else "false"
            labels = {**L, "allocator": alloc.get("name") or "unknown",
                      "version": alloc.get("mimalloc_version") or "", "mimalloc_live": live}
            metric("appliance:allocator_info", "gauge",
                   "The engine process's malloc, checked from inside it (1 for the one in use).",
                   [f"appliance:allocator_info{_labels(labels)} 1"])
        out.extend(self.render_vllm(engine))
        return "\n".join(out) + "\n"

    def render_vllm(self, engine: dict) -> list[str]:
        """The same measurements under vLLM's metric names, types and meanings, so dashboards and
        alerts written for vLLM work unchanged. Differences from vLLM: time_per_output_token is the
        gap between two consecutive output steps of a request (vLLM's per-token observation; equal
        to inter_token_latency), and gpu_cache_usage_perc (vLLM's deprecated alias) is the CPU KV cache."""
        L = self.labels
        out: list[str] = []
        metric = _emitter(out)

        for name, key, help_ in (
            ("vllm:num_requests_running", "num_running", "Number of requests in model execution batches."),
            ("vllm:num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
            ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
            ("vllm:gpu_cache_usage_perc", "kv_cache_usage",
             "KV-cache usage (vLLM's older name; here the CPU KV cache). 1 means 100 percent usage."),
        ):
            metric(name, "gauge", help_, _engine_samples(name, key, L, engine))
        for name, value, help_ in (
            ("vllm:prompt_tokens_total", self.prompt_tokens, "Number of prefill tokens processed."),
            ("vllm:generation_tokens_total", self.generation_tokens, "Number of generation tokens processed."),
            ("vllm:prefix_cache_queries_total", engine.get("prefix_cache_queries", 0),
             "Prefix cache queries, in terms of number of queried tokens."),
            ("vllm:prefix_cache_hits_total", engine.get("prefix_cache_hits", 0),
             "Prefix cache hits, in terms of number of cached tokens."),
            ("vllm:num_preemptions_total", engine.get("num_preemptions", 0), "Cumulative number of preemptions."),
        ):
            metric(name, "counter", help_, [f"{name}{_labels(L)} {_fmt(value)}"])
        if "spec_decode_num_drafts" in engine:  # vLLM's speculative decoding counters
            for name, key, help_ in (
                ("vllm:spec_decode_num_drafts_total", "spec_decode_num_drafts", "Number of spec decoding drafts."),
                ("vllm:spec_decode_num_draft_tokens_total", "spec_decode_num_draft_tokens", "Number of draft tokens."),
                ("vllm:spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens",
                 "Number of accepted tokens."),
            ):
                metric(name, "counter", help_, [f"{name}{_labels(L)} {_fmt(engine.get(key, 0))}"])
            per_pos = engine.get("spec_decode_num_accepted_tokens_per_pos") or []
            metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Accepted tokens per draft's position.",
                   [f"vllm:spec_decode_num_accepted_tokens_per_pos_total{_labels({**L, 'position': str(i)})} {n}"
                    for i, n in enumerate(per_pos)])
        metric("vllm:request_success_total", "counter", "Count of successfully processed requests.",
               [f"vllm:request_success_total{_labels({**L, 'finished_reason': r})} {n}"
                for r, n in self.requests.items()])
        for name, h, help_ in (
            ("vllm:time_to_first_token_seconds", self.ttft, "Histogram of time to first token in seconds."),
            ("vllm:time_per_output_token_seconds", self.itl, "Histogram of time per output token in seconds."),
            ("vllm:inter_token_latency_seconds", self.itl, "Histogram of inter-token latency in seconds."),
            ("vllm:e2e_request_latency_seconds", self.e2e, "Histogram of e2e request latency in seconds."),
            ("vllm:request_queue_time_seconds", self.queue,
             "Histogram of time spent in WAITING phase for request."),
            ("vllm:request_prompt_tokens", self.request_prompt_tokens, "Number of prefill tokens processed."),
            ("vllm:request_generation_tokens", self.request_generation_tokens,
             "Number of generation tokens processed."),
        ):
            metric(name, "histogram", help_, h.lines(name, L))
        return out
