"""This process's tensor-parallel group: its rank, the group's size and its communicator.

The sharded layers read it once, when they are built (``get_tp_group()`` inside
``tp_group_scope``), and keep the object: a model is built for one group and runs in it. Outside a
scope the group is the single process (rank 0 of 1, no communicator), so single-process code pays
nothing, and a process may hold a tensor-parallel engine next to a single-process one (tests do).
"""
from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Iterator

from appliance.distributed.communicator import Communicator


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    communicator: Communicator | None = None  # None when world_size == 1

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """(offset, length) of this rank's equal part of ``size`` along a sharded dimension."""
        if size % self.world_size:
            raise ValueError(f"tensor_parallel_size={self.world_size} does not divide {what} ({size})")
        n = size // self.world_size
        return self.rank * n, n


_SINGLE = TPGroup()
_current: TPGroup = _SINGLE


def get_tp_group() -> TPGroup:
    return _current


@contextlib.contextmanager
def tp_group_scope(group: TPGroup) -> Iterator[TPGroup]:
    """Build models for ``group`` inside this scope (the runner's constructor)."""
    global _current
    prev, _current = _current, group
    try:
        yield group
    finally:
        _current = prev


def gloo_group(rank: int, world_size: int, host: str, port: int, timeout_s: float, store=None):
    """A gloo process group over a TCP store at ``host:port`` (rank 0 passes the store it created;
    see ``new_store``). ``timeout_s`` bounds every collective and the rendezvous."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def new_store(world_size: int, host: str = "127.0.0.1", timeout_s: float = 60.0):
    """Rank 0's TCP store on a free port (``store.port``), for ``gloo_group``."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_group(rank: int, world_size: int, port: int, timeout_s: float, default: bool, store=None,
               host: str = "127.0.0.1"):
    """This rank's gloo group: torch.distributed's default group when ``default`` (what the "shm"
    communicator sets itself up through: its store and object collectives), else a group of its
    own (``gloo_group``). Returns the group to give ``make_communicator`` (None: the default).
    ``host``: where rank 0's store listens (loopback for local ranks; rank 0's node under Ray)."""
    import torch.distributed as dist

    if not default:
        return gloo_group(rank, world_size, host, port, timeout_s, store=store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    return None
