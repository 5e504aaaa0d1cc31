"""Collective operations between the ranks of one tensor-parallel group.

``Communicator`` is the interface the sharded layers call (``appliance.layers.linear`` and
``appliance.layers.vocab`` through ``parallel_state.TPGroup``); implementations are found by name
through ``register_communicator`` / ``make_communicator``: "gloo" (here, on a torch.distributed
gloo process group: portable, about a millisecond a call on loopback) and "shm" (a shared-memory
all-reduce within one host, registered by ``appliance.distributed.shm_allreduce``).
"""
from __future__ import annotations

from typing import Callable

import torch


class Communicator:
    """Collectives over ``world_size`` ranks; this process is ``rank``. Every rank must make the same
    calls in the same order with tensors of the same shape and dtype."""

    rank: int
    world_size: int

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        raise NotImplementedError

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order (a new tensor)."""
        raise NotImplementedError

    def broadcast_object(self, obj=None, src: int = 0):
        """``src``'s picklable ``obj`` on every rank (the others pass anything; all get src's)."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the communicator holds (segments, sockets); the default holds nothing."""


class GlooCommunicator(Communicator):
    """On a gloo process group (``torch.distributed.ProcessGroupGloo``, used directly rather than
    through the default group so that one process can hold several engines, as tests do). The
    group's timeout bounds every call: a rank that died shows as an error, never as a hang."""

    def __init__(self, group, rank: int, world_size: int):
        self.group, self.rank, self.world_size = group, rank, world_size

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        # gloo reduces contiguous tensors only; a non-contiguous view is reduced through a copy
        buf = t if t.is_contiguous() else t.contiguous()
        self.group.allreduce([buf]).wait()
        if buf is not t:
            t.copy_(buf)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.world_size)]
        self.group.allgather([outs], [t]).wait()
        return torch.cat(outs, dim=dim)

    def broadcast_object(self, obj=None, src: int = 0):
        import pickle

        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size, src)
        if self.rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data, src)
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([t], opts).wait()

    def barrier(self) -> None:
        self.group.barrier().wait()


# name -> factory(group, rank, world_size) -> Communicator
_REGISTRY: dict[str, Callable[..., Communicator]] = {}


def register_communicator(name: str, factory: Callable[..., Communicator]) -> None:
    """Make ``make_communicator(name, ...)`` call ``factory(group, rank, world_size)``. ``group`` is
    the ranks' gloo process group, which a factory may use to set itself up (exchange names, barriers)."""
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ValueError(f"communicator {name!r} is registered twice")
    _REGISTRY[name] = factory


def communicator_names() -> tuple[str, ...]:
    """The registered communicators, after importing the optional ones (each registers itself on
    import: ``shm_allreduce`` where it exists)."""
    import importlib

    for module in _OPTIONAL:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    return tuple(_REGISTRY)


_OPTIONAL = ("appliance.distributed.shm_allreduce",)


def make_communicator(name: str, group, rank: int, world_size: int) -> Communicator:
    factory = _REGISTRY.get(name)
    if factory is None and name in communicator_names():
        factory = _REGISTRY[name]
    if factory is None:
        raise ValueError(f"communicator must be one of {', '.join(_REGISTRY)}; got {name!r}")
    return factory(group, rank, world_size)


register_communicator("gloo", GlooCommunicator)
