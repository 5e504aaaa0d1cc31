"""The collective operations tensor-parallel layers call, behind one interface, with a registry of
implementations: ``"gloo"`` (torch.distributed on whatever group it is given) and ``"shm"``
(appliance/distributed/shm_allreduce.py: a native shared-memory all-reduce within one host).

Every rank of a group makes its communicator with the same name, in the same order, after
``torch.distributed.init_process_group``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch
import torch.distributed as dist


class Communicator(ABC):
    """Collectives over one process group. ``rank`` and ``world_size`` are within the group."""

    rank: int
    world_size: int

    @abstractmethod
    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""

    @abstractmethod
    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order (a new tensor)."""

    @abstractmethod
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``obj`` of rank ``src`` (picklable), returned on every rank."""

    @abstractmethod
    def barrier(self) -> None: ...

    def close(self) -> None:
        """Release what the communicator holds (shared memory); collectives after this are an error."""

    def native_all_reduce(self) -> tuple[int, int] | None:
        """(C function address, handle) of an in-place sum that native code may call by itself (the
        one-call decoder stack, ``ops.native.llama_layers``), or None when the communicator has none
        (the stack then does not run: the per-op path reduces through ``all_reduce_``)."""
        return None


class GlooCommunicator(Communicator):
    """torch.distributed collectives on ``group`` (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int):
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous():
            dist.all_reduce(t, group=self.group)
        else:  # collectives need dense memory; reduce a copy and write it back
            c = t.contiguous()
            dist.all_reduce(c, group=self.group)
            t.copy_(c)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=self._global_rank(src), group=self.group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


_FACTORIES: dict[str, Callable[..., Communicator]] = {}


def register_communicator(name: str, factory: Callable[..., Communicator]) -> None:
    """``factory(group, rank, world_size)`` -> Communicator, made by ``make_communicator(name, ...)``."""
    _FACTORIES[name] = factory


def communicator_names() -> tuple[str, ...]:
    """The communicators that can be made here: the registered ones and "shm" when its module
    imports (it registers itself on import)."""
    if "shm" not in _FACTORIES:
        try:
            import appliance.distributed.shm_allreduce  # noqa: F401
        except ImportError:
            pass
    return tuple(sorted(_FACTORIES))


def make_communicator(name: str, group: dist.ProcessGroup | None, rank: int, world_size: int) -> Communicator:
    if name == "shm" and name not in _FACTORIES:
        import appliance.distributed.shm_allreduce  # noqa: F401  (registers itself)
    if name not in _FACTORIES:
        raise ValueError(f"communicator {name!r} is not registered; registered: {', '.join(sorted(_FACTORIES))}")
    return _FACTORIES[name](group, rank, world_size)


register_communicator("gloo", GlooCommunicator)
