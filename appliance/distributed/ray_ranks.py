"""Tensor-parallel worker ranks (1..N-1) as Ray actors (``--distributed-executor-backend ray``).

Rank 0 stays the engine (``TPExecutor`` in the engine process, as vLLM keeps its driver worker there);
the other ranks run ``executor.worker_main`` (the very loop a spawned rank runs) on a thread of a
``RankActor``, over two in-memory queues that stand in for its pipe end. On rank 0's side a
``RayRank`` has the ``multiprocessing`` Process and Connection methods ``TPExecutor`` uses
(``send_bytes``, ``poll``, ``recv``, ``is_alive``, ``join``, ``kill``), so the typed messages, the
schedule encoding, the start-up handshake and the failure handling are the same code.

The actors sit in one placement group, one bundle per rank with the rank's CPUs
(``server.ray_executor.RayReplicaSet``: Ray on loopback with usage statistics off, or the cluster of
``RAY_ADDRESS``), each with its rank's OpenMP environment. torch.distributed meets at the TCP store
rank 0 serves, at rank 0's node address. Ranks on one host all-reduce through shared memory, as
spawned ranks do; across hosts the communicator falls back to gloo by itself.

This module is torch-free: a Ray worker imports it to build the actor, and the rank's CPUs are set
before anything imports torch (libgomp binds its threads at that import; see ``rank_worker``).
"""
from __future__ import annotations

import logging
import os
import pickle
import threading

log = logging.getLogger("appliance.distributed")


class _ActorConn:
    """The worker's end of the pipe, inside the actor: what ``worker_main`` calls on it."""

    def __init__(self, inbox, outbox):
        self.inbox, self.outbox = inbox, outbox

    def send(self, obj) -> None:
        self.outbox.send(obj)

    def recv_bytes(self) -> bytes:
        return self.inbox.recv()  # EOFError once rank 0 closed it: the worker loop ends


class RankActor:
    """One worker rank in a Ray actor (made remote by ``RayReplicaSet.create_actor``; ``send`` and
    ``recv`` run while the rank's thread steps, so it needs ``max_concurrency`` > 1)."""

    def __init__(self):
        from appliance.server.ray_executor import _Box

        self.inbox, self.outbox = _Box(), _Box()
        self.thread: threading.Thread | None = None

    def start(self, rank: int, cpus: tuple[int, ...] | None, payload: bytes) -> int:
        if cpus:
            try:
                os.sched_setaffinity(0, set(cpus))
            except OSError:  # a cpuset that forbids them: worker_startup reports where the threads run
                pass
        self.thread = threading.Thread(target=self._run, args=(rank, payload), name=f"appliance-tp-rank{rank}",
                                       daemon=True)
        self.thread.start()
        return os.getpid()

    def _run(self, rank: int, payload: bytes) -> None:
        from appliance.distributed.executor import worker_main

        try:
            worker_main(rank, _ActorConn(self.inbox, self.outbox), *pickle.loads(payload))
        except SystemExit:
            pass  # the error went to rank 0 already
        finally:
            self.outbox.close()

    def send(self, data: bytes) -> None:
        self.inbox.send(data)

    def recv(self, timeout: float = 1.0) -> list | None:
        return self.outbox.take(timeout)

    def exit(self) -> None:
        import ray

        ray.actor.exit_actor()


class RayRank:
    """Rank 0's handle on one ``RankActor``: a Process and a Connection in one object."""

    def __init__(self, actor, rank: int):
        from appliance.server.ray_executor import _Box

        self.actor, self.rank = actor, rank
        self.pid: int | None = None
        self.exitcode: int | None = None
        self._box = _Box()  # what the actor sent, read ahead by the reader thread
        self._reader = threading.Thread(target=self._read, name=f"appliance-tp-ray-rank{rank}", daemon=True)

    def start(self, cpus, payload: bytes) -> None:
        self._started = self.actor.start.remote(self.rank, cpus, payload)
        self._reader.start()

    def _read(self) -> None:
        import ray

        try:
            self.pid = ray.get(self._started)
            while True:
                msgs = ray.get(self.actor.recv.remote(1.0))
                if msgs is None:  # the rank's loop ended
                    self.exitcode = 0
                    return
                for m in msgs:
                    self._box.send(m)
        except ray.exceptions.RayError as e:
            log.debug("tensor-parallel rank %d actor: %s", self.rank, e)
            self.exitcode = 1
        finally:
            if self.exitcode is None:
                self.exitcode = 1
            self._box.close()

    # -- multiprocessing.Process
    def is_alive(self) -> bool:
        return self._reader.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._reader.join(timeout)

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass

    # -- multiprocessing.Connection
    def send_bytes(self, data: bytes) -> None:
        import ray

        try:
            # waited for: a threaded actor may run concurrent calls in any order, and steps must not
            ray.get(self.actor.send.remote(data))
        except ray.exceptions.RayError as e:
            raise OSError(f"tensor-parallel rank {self.rank} actor is gone ({type(e).__name__})") from None

    def poll(self, timeout: float | None = 0) -> bool:
        return self._box.poll(timeout)

    def recv(self):
        return self._box.recv()

    def close(self) -> None:
        """After ``stop``: end the actor itself (its loop has ended or is ending)."""
        import ray

        try:
            ray.get(self.actor.exit.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            pass  # exited, as asked
        except Exception:  # noqa: BLE001 - stuck: kill it from outside
            self.kill()


def start_rank_actors(placements: list, payload_for, env_for, replica: int | None = None, spec: str = "auto",
                      num_threads: int | None = None, local_allowed: set[int] | None = None):
    """Ranks 1..N-1 as actors in one placement group, one bundle per rank sized by the driver's plan
    ``placements`` (every rank's, rank 0's first); once placed, every rank's CPUs are planned again on
    the node it landed on (``RayReplicaSet.node_placements``, rank 0 on this process's node, with
    ``spec``, ``num_threads`` and this node's ``local_allowed`` CPUs): on one host that is the
    driver's plan, on several each node's ranks share that node's NUMA nodes / cores.
    ``payload_for(rank, host, placement)``: the rank's ``worker_main`` arguments (pickled), given the
    address its TCP store client reaches rank 0 at; ``env_for(placement)``: its environment;
    ``replica``: the data-parallel replica these ranks serve (its index goes into the group's and
    actors' names, which are unique in a Ray namespace). Returns (the ``RayReplicaSet`` to stop at
    close, [``RayRank``], every rank's placement as planned on its node)."""
    import ray

    from appliance.server.ray_executor import RayReplicaSet

    tag = "" if replica is None else f"-dp{replica}"
    ray_set = RayReplicaSet(placements[1:], name=f"appliance-tp-ranks{tag}")
    ray_set.start()
    ranks = []
    try:
        planned = ray_set.node_placements(spec, num_threads, local_allowed if local_allowed is not None
                                          else set(os.sched_getaffinity(0)), leading_local=1)
        host = ray.util.get_node_ip_address()  # rank 0's node
        for i, p in enumerate(planned[1:]):
            r = RayRank(ray_set.create_actor(i, env_for(p), cls=RankActor, name=f"appliance{tag}-tp-rank{i + 1}"),
                        i + 1)
            r.start(p.cpus, payload_for(i + 1, host, p))
            ranks.append(r)
    except BaseException:
        for r in ranks:
            r.kill()
        ray_set.stop()
        raise
    return ray_set, ranks, planned
