"""Two tensor-parallel ranks inside the test process: each a thread with its own gloo process group
over loopback (a real gloo all-reduce between two groups), so layer tests need no process start.
Layers are built rank by rank inside ``tp_group_scope`` (the scope is process-wide, so never two at
once) and then run on both threads together, as two processes would run them."""
from __future__ import annotations

import threading

from appliance.distributed.communicator import make_communicator
from appliance.distributed.parallel_state import TPGroup, gloo_group, new_store, tp_group_scope


class Ranks:
    def __init__(self, world_size: int = 2):
        store = new_store(world_size, timeout_s=30)
        self.world_size = world_size
        groups: dict[int, object] = {}

        def join(r):
            groups[r] = gloo_group(r, world_size, "127.0.0.1", store.port, 30.0, store=store if r == 0 else None)

        threads = [threading.Thread(target=join, args=(r,)) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self._store = store
        self.groups = [TPGroup(r, world_size, make_communicator("gloo", groups[r], r, world_size))
                       for r in range(world_size)]

    def build(self, make):
        """``make(rank)`` for every rank, each inside its group's scope (one after the other)."""
        out = []
        for g in self.groups:
            with tp_group_scope(g):
                out.append(make(g.rank))
        return out

    def run(self, fn):
        """``fn(rank)`` on every rank at once (threads); returns the results in rank order."""
        res: list = [None] * self.world_size
        err: list = []

        def go(r):
            try:
                res[r] = fn(r)
            except BaseException as e:  # re-raised in the test's thread
                err.append(e)

        threads = [threading.Thread(target=go, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a rank hung"
        if err:
            raise err[0]
        return res
