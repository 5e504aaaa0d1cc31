"""Data parallel: several engine cores behind one OpenAI server.

``DPEngineClient`` has the interface of ``AsyncEngineClient`` (``info``, ``streams``, ``dead``,
``add_request``, ``abort``, ``get_stats``, ``num_in_flight``, the life-cycle calls), so the serving
layer, the API and the drain logic use it unchanged. Each replica is an ``AsyncEngineClient`` of its
own (a spawned process, or a Ray actor with ``--distributed-executor-backend ray``) with its own CPUs
and KV cache; the set only routes:

- a new request goes to the replica with the fewest sequences in flight (running + waiting). The
  count is the frontend's own (a stream is added the moment it is routed and removed when its final
  delta arrives), so it is never a step behind as the core's stats are; ties go to the core's last
  reported running + waiting, then the lowest index;
- an abort or stop-sequence message goes to the replica that owns the request (each replica's client
  only knows its own streams);
- ``get_stats`` asks every replica at once and returns the totals (as one engine would report them)
  plus ``replicas``: each one's own stats, which /metrics labels ``engine="<index>"`` as vLLM does.

A replica that dies takes the server with it: its streams end with its error, the other replicas'
in-flight streams end with an error naming it (a set that silently lost part of its capacity would
look healthy to a load balancer), ``dead`` is set so new requests get 503, and the launcher exits
non-zero (``launcher._Server``).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading

from appliance.config import EngineConfig
from appliance.errors import ApplianceError, InvalidRequestError
from appliance.runtime import threads
from appliance.server.async_engine import AsyncEngineClient, EngineDeadError, RequestStream
from appliance.server.engine_core import AbortRequests

log = logging.getLogger("appliance.server")

# Summed over replicas for the totals; kv_cache_usage is averaged (every replica has the same size).
_SUMMED = ("num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "steps",
           "prefill_capped_steps")


def _spec_totals(per: list[dict]) -> dict:
    """Speculative decoding over replicas: the counters summed, the rates recomputed from the sums
    (an average of per-replica rates would weigh an idle replica like a busy one)."""
    t = {k: sum(s.get(k, 0) for s in per) for k in
         ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
          "spec_decode_num_trimmed_tokens")}
    per_pos = [s.get("spec_decode_num_accepted_tokens_per_pos") or [] for s in per]
    t["spec_decode_num_accepted_tokens_per_pos"] = [
        sum(p[i] for p in per_pos if i < len(p)) for i in range(max(map(len, per_pos)))]
    t["spec_decode_acceptance_rate"] = (t["spec_decode_num_accepted_tokens"] / t["spec_decode_num_draft_tokens"]
                                        if t["spec_decode_num_draft_tokens"] else 0.0)
    t["spec_decode_mean_accepted_length"] = (1 + t["spec_decode_num_accepted_tokens"] / t["spec_decode_num_drafts"]
                                             if t["spec_decode_num_drafts"] else 0.0)
    return t


def replica_rank_groups(config: EngineConfig, allowed: set[int] | None = None) -> list[list[threads.Placement]]:
    """Each replica's tensor-parallel ranks' Placements (``threads.resolve_ranks`` over data-parallel
    size x tensor-parallel size ranks, replica i's ranks the i-th run of ``tensor_parallel_size``):
    "0-31|32-63|64-95|96-127" one list per rank, replica by replica; ``auto`` one rank per NUMA node
    when there are enough nodes, else the physical cores split evenly; ``nobind``. ApplianceError
    naming the flags, the value and what is valid. On top of resolve_ranks, which only warns about
    oversubscription: ranks x threads per rank must fit the cores, since ranks that time-share cores
    would each run slower than one engine on all of them."""
    n, tp = config.data_parallel_size, config.tensor_parallel_size
    total = n * tp
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    spec = (config.omp_threads_bind or "auto").strip()
    nt = config.num_threads
    cores = len(threads.one_cpu_per_core(sorted(allowed)))
    if "|" not in spec and total > cores:
        raise ApplianceError(_too_many(n, tp, max(nt or 1, 1), cores, nt, spec))
    out = threads.resolve_ranks(spec, total, nt, allowed)
    if total > 1:
        if spec == "nobind":
            if sum(p.num_threads for p in out) > len(allowed):
                raise ApplianceError(_too_many(n, tp, out[0].num_threads, len(allowed), nt, spec))
        else:
            for p in out:
                if p.cpus and p.num_threads > len(p.cpus):
                    have = sum(len(q.cpus or ()) for q in out)
                    raise ApplianceError(_too_many(n, tp, p.num_threads, have, nt, spec))
    return [out[i * tp:(i + 1) * tp] for i in range(n)]


def replica_placements(config: EngineConfig, allowed: set[int] | None = None) -> list[threads.Placement]:
    """One Placement per replica: its rank's, or with tensor parallelism every one of its ranks' CPUs
    (the replica's engine process is its rank 0 and starts the others; ``threads.ranks_union``)."""
    spec = (config.omp_threads_bind or "auto").strip()
    groups = replica_rank_groups(config, allowed)
    return [g[0] if len(g) == 1 else threads.ranks_union(g, spec) for g in groups]


def replica_configs(config: EngineConfig, groups: list[list[threads.Placement]]) -> list[EngineConfig]:
    """Each replica's own config. Without tensor parallelism the set's (the replica's placement is
    given to its process directly). With it, replica i's copy has ``data_parallel_rank=i`` and its
    ranks' CPU lists as its ``omp_threads_bind`` (unpinned ranks: nobind with the threads planned
    for each), which its tensor-parallel executor resolves as one engine would."""
    if config.tensor_parallel_size == 1:
        return [config] * len(groups)
    out = []
    for i, g in enumerate(groups):
        spec = threads.rank_lists_spec(g)
        out.append(config.replace(data_parallel_rank=i, omp_threads_bind=spec,
                                  num_threads=g[0].num_threads if spec == "nobind" else config.num_threads))
    return out


def _too_many(n: int, tp: int, per: int, have: int, nt: int | None, spec: str = "nobind") -> str:
    what = f"--num-threads {nt}" if nt else "at least 1 thread"
    if tp == 1:
        return (f"--data-parallel-size {n} x {what} per replica = {n * per} threads, but --omp-threads-bind "
                f"{spec!r} gives {have} CPU core(s); valid: --data-parallel-size <= {have}"
                + (f" and --num-threads <= {max(1, have // n)}" if nt else ""))
    return (f"--data-parallel-size {n} x --tensor-parallel-size {tp} = {n * tp} ranks x {what} per rank = "
            f"{n * tp * per} threads, but --omp-threads-bind {spec!r} gives {have} CPU core(s); valid: "
            f"--data-parallel-size x --tensor-parallel-size <= {have}"
            + (f" and --num-threads <= {max(1, have // (n * tp))}" if nt else ""))


def check_backend(config: EngineConfig) -> None:
    """``--distributed-executor-backend ray`` without Ray installed, or with an
    ``APPLIANCE_RAY_PLACEMENT_STRATEGY`` that is no strategy: refused before anything starts."""
    if config.distributed_executor_backend == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ApplianceError('--distributed-executor-backend ray: the ray package is not installed; '
                                 'install it with: pip install "appliance[ray]" (or use --distributed-executor-'
                                 'backend mp)') from None
        from appliance.server.ray_executor import placement_strategy

        placement_strategy()  # APPLIANCE_RAY_PLACEMENT_STRATEGY: refused here if it names no strategy


def uses_replica_set(config: EngineConfig) -> bool:
    """The one-process path stays as it was unless data parallel or Ray is asked for. One
    tensor-parallel engine under Ray is that one process too: rank 0 is the engine core (as vLLM's
    driver worker), its ranks 1..N-1 Ray actors (appliance/distributed/ray_ranks.py)."""
    if config.tensor_parallel_size > 1 and config.data_parallel_size == 1:
        return False
    return config.data_parallel_size > 1 or config.distributed_executor_backend != "mp"


class DPEngineClient:
    def __init__(self, config: EngineConfig, log_level: int = logging.INFO):
        check_backend(config)
        self.config = config
        self.log_level = log_level
        self._allowed = set(os.sched_getaffinity(0))
        self.rank_groups = replica_rank_groups(config, self._allowed)
        spec = (config.omp_threads_bind or "auto").strip()
        self.placements = [g[0] if len(g) == 1 else threads.ranks_union(g, spec) for g in self.rank_groups]
        configs = replica_configs(config, self.rank_groups)
        self.info: dict = {}
        self.dead: str | None = None
        self.last_stats: dict = {}
        self._ray = None
        self.hosts: list[str] | None = None  # under Ray: each replica's node's host name
        if config.distributed_executor_backend == "ray":
            from appliance.server.ray_executor import RayEngineClient, RayReplicaSet

            # a replica actor is its rank 0; its other ranks are actors of their own (ray_ranks)
            self._ray = RayReplicaSet(self.placements, bundle_threads=[g[0].num_threads for g in self.rank_groups])
            self.replicas: list[AsyncEngineClient] = [
                RayEngineClient(c, self._ray, i, log_level) for i, c in enumerate(configs)]
        else:
            self.replicas = [AsyncEngineClient(c, log_level) for c in configs]
        for i, (r, p) in enumerate(zip(self.replicas, self.placements)):
            r.placement = p
            r.name = f"appliance-engine-core-{i}"
            r.on_dead = self._replica_died(i)
        self._owner: dict[str, int] = {}  # request id -> replica index, while in flight
        self.routed = [0] * len(self.replicas)  # requests sent to each replica (a /metrics counter)

    # -- what the serving layer sets and reads -----------------------------------------------------
    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @tokenizer.setter
    def tokenizer(self, tok) -> None:
        for r in self.replicas:
            r.tokenizer = tok

    @property
    def on_delta(self):
        return self.replicas[0].on_delta

    @on_delta.setter
    def on_delta(self, fn) -> None:
        for r in self.replicas:
            r.on_delta = fn

    @property
    def streams(self) -> dict[str, RequestStream]:
        """Every replica's in-flight streams (a fresh dict: read it, do not write it)."""
        out: dict[str, RequestStream] = {}
        for r in self.replicas:
            out.update(r.streams)
        return out

    @property
    def num_in_flight(self) -> int:
        return sum(len(r.streams) for r in self.replicas)

    # -- life cycle ---------------------------------------------------------------------------------
    def start_process(self) -> None:
        """Start every replica; they load the model at the same time, each on its own CPUs."""
        if self._ray is not None:
            self._ray.start()
            self._plan_on_nodes()
        for r in self.replicas:
            r.start_process()

    def _plan_on_nodes(self) -> None:
        """Under Ray: each replica's ranks planned again on the node its actor was placed on (on one
        host this is the plan made at construction; across hosts each node's CPU numbering)."""
        tp = self.config.tensor_parallel_size
        spec = (self.config.omp_threads_bind or "auto").strip()
        flat = self._ray.node_placements(spec, self.config.num_threads, self._allowed, ranks_per_bundle=tp)
        self.rank_groups = [flat[i * tp:(i + 1) * tp] for i in range(len(self.replicas))]
        self.placements = [g[0] if tp == 1 else threads.ranks_union(g, spec) for g in self.rank_groups]
        for r, c, p in zip(self.replicas, replica_configs(self.config, self.rank_groups), self.placements):
            r.config, r.placement = c, p
        self.hosts = self._ray.node_hosts()

    def wait_ready(self, timeout: float | None = None) -> dict:
        infos = []
        for i, r in enumerate(self.replicas):
            try:
                infos.append(r.wait_ready(timeout))
            except ApplianceError as e:
                raise ApplianceError(f"data-parallel replica {i}: {e}") from None
        info = dict(infos[0])
        n = len(infos)
        # What the serving layer checks against: admission counts the whole set's sequences.
        info["max_num_seqs"] = sum(i["max_num_seqs"] for i in infos)
        info["data_parallel_size"] = n
        info["distributed_executor_backend"] = self.config.distributed_executor_backend
        hosts = self.hosts or [None] * n
        info["replicas"] = [{"pid": i["pid"], "num_threads": i["num_threads"], "num_kv_blocks": i["num_kv_blocks"],
                             "cpus": threads.format_cpu_list(list(p.cpus)) if p.cpus else "not pinned",
                             **({"host": h} if h else {}),
                             **({"ranks": threads.rank_lists_spec(g), "tensor_parallel": i.get("tensor_parallel")}
                                if len(g) > 1 else {})}
                            for i, p, g, h in zip(infos, self.placements, self.rank_groups, hosts)]
        self.info = info
        return info

    def start(self, timeout: float | None = None) -> dict:
        self.start_process()
        return self.wait_ready(timeout)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        for r in self.replicas:
            r.attach(loop)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every replica at once (each aborts what it still holds)."""
        ts = [threading.Thread(target=r.shutdown, args=(timeout,), daemon=True) for r in self.replicas]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout + 10)
        if self._ray is not None:
            # bounded: a Ray whose raylet is gone (a group-wide SIGTERM reaches it too) can block here
            t = threading.Thread(target=self._ray.stop, name="ray-stop", daemon=True)
            t.start()
            t.join(timeout + 10)
            if t.is_alive():
                log.warning("Ray did not stop within %.0f s; exiting without it", timeout + 10)

    # -- requests -----------------------------------------------------------------------------------
    def _pick(self) -> int:
        def load(i: int):
            r = self.replicas[i]
            local = sum(s.num_seqs for s in r.streams.values())
            core = r.last_stats.get("num_running", 0) + r.last_stats.get("num_waiting", 0)
            return (local, core, i)

        return min(range(len(self.replicas)), key=load)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params,
                    queue: asyncio.Queue | None = None) -> RequestStream:
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed: {self.dead}")
        if any(request_id in r.streams for r in self.replicas):
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", "request_id")
        i = self._pick()
        stream = self.replicas[i].add_request(request_id, prompt_token_ids, params, queue)
        self._owner[request_id] = i
        self.routed[i] += 1
        return stream

    def abort(self, request_ids: list[str], notify: bool = False) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self._owner.pop(rid, None)
            if i is None:  # finished already, or never ours: ask every replica (each ignores strangers)
                for j, r in enumerate(self.replicas):
                    if rid in r.streams:
                        by_replica.setdefault(j, []).append(rid)
            else:
                by_replica.setdefault(i, []).append(rid)
        for i, rids in by_replica.items():
            self.replicas[i].abort(rids, notify=notify)
        self._forget_finished()

    def _forget_finished(self) -> None:
        if len(self._owner) > 2 * self.num_in_flight + 64:  # finished streams leave their replica's dict only
            live = self.streams
            self._owner = {k: v for k, v in self._owner.items() if k in live}

    def owner_of(self, request_id: str) -> int | None:
        """The replica that runs (or ran) ``request_id``; for tests and logs."""
        return self._owner.get(request_id)

    async def get_stats(self, timeout: float = 5.0) -> dict:
        per = await asyncio.gather(*(r.get_stats(timeout) for r in self.replicas), return_exceptions=True)
        per = [s if isinstance(s, dict) else r.last_stats for s, r in zip(per, self.replicas)]
        per = [{**s, "num_requests_routed": n} for s, n in zip(per, self.routed)]
        total: dict = {k: sum(s.get(k, 0) for s in per) for k in _SUMMED}
        total["kv_cache_usage"] = sum(s.get("kv_cache_usage", 0) for s in per) / len(per)
        if any("spec_decode_num_drafts" in s for s in per):
            total.update(_spec_totals(per))
        total["replicas"] = per
        self.last_stats = total
        self._forget_finished()
        return total

    # -- a replica died -----------------------------------------------------------------------------
    def _replica_died(self, index: int):
        def on_dead(message: str) -> None:
            if self.dead is None:
                self.dead = f"data-parallel replica {index} died: {message}"
                log.error("%s; ending every in-flight request and stopping the server", self.dead)
            for j, r in enumerate(self.replicas):
                if j == index or not r.streams:
                    continue
                rids = list(r.streams)
                for s in r.streams.values():
                    s.finished = True
                    s.queue.put_nowait(EngineDeadError(f"the engine failed: {self.dead}"))
                r.streams.clear()
                r._send_q.put(AbortRequests(rids))  # free them in that core; the server is stopping anyway
        return on_dead


__all__ = ["DPEngineClient", "check_backend", "replica_configs", "replica_placements", "replica_rank_groups",
           "uses_replica_set"]
