"""``--distributed-executor-backend ray``: each data-parallel replica's engine core runs as a Ray actor.

The actor speaks the engine core's typed messages (appliance/server/engine_core.py): ``start``
returns ``Ready`` or ``StartupFailed``, ``send`` takes a list of frontend messages (``AddRequest``,
``AbortRequests``, ``StopSequences``, ``GetStats``, ``Shutdown``), ``recv`` returns the core's
(``StepOutputs``, ``RequestError``, ``Stats``, ``EngineDead``). Inside, the very loop the spawned
process runs (``serve_engine_core``) runs on a thread of the actor, over two in-memory queues that
stand in for the pipe ends. ``RayEngineClient`` is ``AsyncEngineClient`` with its pipe replaced by
those calls, so routing, detokenization, stop strings, metrics and drain are the same code.

Ray runs on loopback (``address="local"``: a private one-node cluster, never one that happens to be
running) with no dashboard and usage statistics off; ``RAY_ADDRESS`` set in the environment joins
that cluster instead. One placement group holds one bundle per replica (its CPUs); each actor runs
in its bundle with the replica's OpenMP environment (thread count, places, allocator preload).

Tensor-parallel worker ranks as actors: appliance/distributed/ray_ranks.py (its own placement group
through ``RayReplicaSet``, one bundle per rank; rank 0 is the engine).

Several hosts (a multi-node ``RAY_ADDRESS``): the placement group's strategy is PACK by default (as
vLLM's Ray executor: as few nodes as the bundles fit on), or ``APPLIANCE_RAY_PLACEMENT_STRATEGY``
(SPREAD, STRICT_PACK, STRICT_SPREAD). Once the group is placed, ``RayReplicaSet`` learns which node
each bundle landed on and reads every other node's topology there (a zero-CPU task on that node), and
``node_placements`` plans each actor's CPUs on its own node (``threads.node_rank_placements``): the
bundles' CPU counts come from the driver's plan (nodes alike, as Ray clusters usually are), the CPU
numbers from the node the actor runs on.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time

from appliance.config import EngineConfig
from appliance.errors import ApplianceError
from appliance.server.async_engine import AsyncEngineClient
from appliance.server.engine_core import EngineDead, Ready, Shutdown, StartupFailed

log = logging.getLogger("appliance.server")


class _Box:
    """A message queue with a pipe end's methods: ``send``, ``poll(timeout)``, ``recv``; ``close``
    makes ``recv`` raise EOFError once it is empty (as a closed pipe does)."""

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    def send(self, msg) -> None:
        with self._cond:
            self._items.append(msg)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def poll(self, timeout: float | None = 0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._items or self._closed, timeout)

    def recv(self):
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed)
            if not self._items:
                raise EOFError("closed")
            return self._items.popleft()

    def take(self, timeout: float) -> list | None:
        """Everything queued (waiting up to ``timeout`` for the first); None once closed and empty."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed, timeout)
            if not self._items and self._closed:
                return None
            out = list(self._items)
            self._items.clear()
            return out


class EngineCoreActor:
    """The engine core in a Ray actor (made remote by ``RayReplicaSet.create_actor``; it needs
    ``max_concurrency`` > 1 so ``send`` and ``recv`` run while the loop thread steps)."""

    def __init__(self):
        self.inbox = _Box()
        self.outbox = _Box()
        self.thread: threading.Thread | None = None

    def start(self, config: EngineConfig, placement, log_level: int = logging.INFO):
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine] %(message)s")
        from appliance.server.engine_core import start_engine_core

        core, msg = start_engine_core(config, placement)
        if core is not None:
            self.thread = threading.Thread(target=self._run, args=(core, placement), name="engine-core", daemon=True)
            self.thread.start()
        return msg

    def _run(self, core, placement) -> None:
        from appliance.server.engine_core import serve_engine_core

        if placement is not None:  # OpenMP's thread count is a per-thread setting: this thread steps
            import torch

            torch.set_num_threads(placement.num_threads)
        try:
            serve_engine_core(core, self.inbox, self.outbox)
        finally:
            self.outbox.close()

    def send(self, msgs: list) -> None:
        for m in msgs:
            self.inbox.send(m)

    def recv(self, timeout: float = 1.0) -> list | None:
        return self.outbox.take(timeout)

    def join(self, timeout: float) -> bool:
        """Wait for the loop to end (after Shutdown); True if it did."""
        if self.thread is None:
            return True
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def pid(self) -> int:
        return os.getpid()

    def exit(self) -> None:
        """End the actor from inside (its caller sees ActorDiedError): a ``ray.kill`` from outside
        SIGTERMs the worker, which can print a traceback from whatever Python code it interrupts."""
        import ray

        ray.actor.exit_actor()


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
STRATEGY_VAR = "APPLIANCE_RAY_PLACEMENT_STRATEGY"


def placement_strategy() -> str:
    """The placement group strategy: ``APPLIANCE_RAY_PLACEMENT_STRATEGY`` (default PACK), checked."""
    s = os.environ.get(STRATEGY_VAR, "").strip().upper() or "PACK"
    if s not in PLACEMENT_STRATEGIES:
        raise ApplianceError(f"{STRATEGY_VAR}={os.environ[STRATEGY_VAR]!r} is not a Ray placement group strategy; "
                             f"valid: {', '.join(PLACEMENT_STRATEGIES)}")
    return s


def _node_topology():
    """Run on a node (as a Ray task): that node's topology for placement."""
    from appliance.runtime.threads import local_topology

    return local_topology()


class RayReplicaSet:
    """The Ray side of a replica set: Ray itself, the placement group (one bundle per replica), the actors."""

    def __init__(self, placements: list, name: str = "appliance-replicas", bundle_threads: list[int] | None = None):
        """``bundle_threads``: each actor's CPUs in its bundle when not its placement's threads (a
        tensor-parallel replica's actor is its rank 0; its other ranks reserve theirs as actors of
        their own, out of the CPUs Ray is started with: every placement's threads)."""
        self.placements = placements
        self.name = name
        self.bundle_threads = bundle_threads or [p.num_threads for p in placements]
        self.pg = None
        self.started_ray = False
        self.strategy = placement_strategy()
        self.local_node: str | None = None  # this process's Ray node id
        self.bundle_nodes: list[str] = []  # the node id each bundle was placed on
        self.topologies: dict = {}  # node id -> threads.NodeTopology

    def start(self) -> None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray
        from ray.util.placement_group import placement_group

        want = sum(p.num_threads for p in self.placements)
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
            else:
                ray.init(address="local", num_cpus=max(want, len(os.sched_getaffinity(0))),
                         include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True,
                         logging_level=logging.WARNING)
            self.started_ray = True
        bundles = [{"CPU": t} for t in self.bundle_threads]
        self.pg = placement_group(bundles, strategy=self.strategy, name=self.name)
        try:
            ray.get(self.pg.ready(), timeout=60)
        except Exception as e:  # noqa: BLE001 - ray raises its own timeout types
            raise ApplianceError(f"--distributed-executor-backend ray: the placement group of {len(bundles)} "
                                 f"bundle(s) {bundles} ({self.strategy}) was not placed within 60 s "
                                 f"({type(e).__name__}: {e}); Ray sees {ray.cluster_resources().get('CPU', 0)} CPUs "
                                 f"on {len(ray.nodes())} node(s)") from None
        self._learn_nodes()

    def _learn_nodes(self) -> None:
        """Which node each bundle is on, and the topology of every node other than this one (read there)."""
        import ray
        from ray.util import placement_group_table
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.local_node = ray.get_runtime_context().get_node_id()
        where = placement_group_table(self.pg)["bundles_to_node_id"]
        self.bundle_nodes = [where[i] for i in range(len(self.bundle_threads))]
        remote = [n for n in dict.fromkeys(self.bundle_nodes) if n != self.local_node]
        probe = ray.remote(num_cpus=0, max_retries=0)(_node_topology)
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
                for n in remote]
        self.topologies = dict(zip(remote, ray.get(refs, timeout=120)))

    def node_placements(self, spec: str, num_threads: int | None, local_allowed: set[int],
                        leading_local: int = 0, ranks_per_bundle: int = 1) -> list:
        """Every rank's Placement planned on the node it landed on (``threads.node_rank_placements``):
        ``leading_local`` ranks in this process's node first (a tensor-parallel rank 0, which is this
        process and has no bundle), then ``ranks_per_bundle`` ranks per bundle (a data-parallel
        replica's tensor-parallel ranks are planned on its rank 0's node). ``local_allowed``: the CPUs
        this node offers (what the driver's own plan used), so that on one host the plan is the driver's."""
        from appliance.runtime import threads

        topologies = {**self.topologies, self.local_node: threads.local_topology(local_allowed)}
        rank_nodes = [self.local_node] * leading_local + [n for n in self.bundle_nodes for _ in range(ranks_per_bundle)]
        return threads.node_rank_placements(spec, num_threads, rank_nodes, topologies)

    def node_hosts(self) -> list[str]:
        """The host name of each bundle's node."""
        import socket

        return [self.topologies[n].host if n in self.topologies else socket.gethostname() for n in self.bundle_nodes]

    def create_actor(self, index: int, env: dict[str, str], cls=EngineCoreActor, name: str | None = None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return ray.remote(cls).options(
            num_cpus=self.bundle_threads[index], max_concurrency=4, max_restarts=0,
            name=name or f"appliance-engine-core-{index}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                 placement_group_bundle_index=index),
            runtime_env={"env_vars": env},
        ).remote()

    def stop(self) -> None:
        try:
            import ray
            from ray.util.placement_group import remove_placement_group

            if self.pg is not None:
                remove_placement_group(self.pg)
                self.pg = None
            if self.started_ray:
                ray.shutdown()
                self.started_ray = False
        except Exception as e:  # noqa: BLE001 - shutting down: report, do not mask the exit
            log.warning("stopping Ray: %s: %s", type(e).__name__, e)


class RayEngineClient(AsyncEngineClient):
    """One replica's client: ``AsyncEngineClient`` over actor calls instead of a pipe."""

    def __init__(self, config: EngineConfig, ray_set: RayReplicaSet, index: int, log_level: int = logging.INFO):
        super().__init__(config, log_level)
        self.ray_set = ray_set
        self.index = index
        self._actor = None
        self._ready_ref = None

    def start_process(self) -> None:
        from appliance.runtime import threads
        from appliance.runtime.worker import worker_env

        placement = self.placement or threads.resolve(self.config.omp_threads_bind, self.config.num_threads)
        env = worker_env(self.config.allocator, placement=placement)
        self._actor = self.ray_set.create_actor(self.index, env)
        self._ready_ref = self._actor.start.remote(self.config, placement, self.log_level)

    def wait_ready(self, timeout: float | None = None) -> dict:
        import ray

        try:
            msg = ray.get(self._ready_ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise ApplianceError(f"the engine did not load the model within {timeout} s") from None
        except ray.exceptions.RayError as e:
            raise ApplianceError(f"the engine actor failed during start-up: {type(e).__name__}: {e}") from None
        if isinstance(msg, StartupFailed):
            raise ApplianceError(msg.message)
        assert isinstance(msg, Ready), msg
        self.info = msg.info
        return self.info

    def _writer(self) -> None:
        import ray

        while True:
            batch = [self._send_q.get()]
            while not self._send_q.empty():
                batch.append(self._send_q.get())
            stop = None in batch
            batch = [m for m in batch if m is not None]
            try:
                if batch:
                    # one call at a time, waited for: a threaded actor runs concurrent calls in any order
                    ray.get(self._actor.send.remote(batch))
            except ray.exceptions.RayError:
                return
            if stop:
                return

    def _reader(self) -> None:
        import ray

        while True:
            try:
                msgs = ray.get(self._actor.recv.remote(1.0))
            except ray.exceptions.RayError as e:
                msgs = [EngineDead(f"the engine actor exited ({type(e).__name__})")]
            if msgs is None:  # the core's loop ended
                if self._closing:
                    return
                msgs = [EngineDead("the engine core stopped")]
            for msg in msgs:
                if not self._deliver(msg):
                    return

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._actor is None:
            return
        import ray

        self._closing = True
        try:
            if self._threads_started:
                self._send_q.put(Shutdown())
                self._send_q.put(None)
            else:
                ray.get(self._actor.send.remote([Shutdown()]), timeout=timeout)
            deadline = time.monotonic() + timeout
            ray.get(self._actor.join.remote(timeout), timeout=max(0.1, deadline - time.monotonic()) + 2)
        except Exception as e:  # noqa: BLE001 - dead or stuck: it is killed below either way
            log.debug("replica %d did not stop cleanly: %s", self.index, e)
        try:
            ray.get(self._actor.exit.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            pass  # exited, as asked (or already dead)
        except Exception:  # noqa: BLE001 - stuck: kill it from outside
            try:
                ray.kill(self._actor)
            except Exception:  # noqa: BLE001
                pass
        self._actor = None


__all__ = ["EngineCoreActor", "RayEngineClient", "RayReplicaSet"]
