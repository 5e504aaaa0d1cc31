"""The entry point of a tensor-parallel worker process (ranks 1..N-1), torch-free on purpose.

libgomp reads ``OMP_PLACES`` and binds its threads when torch is first imported, and a spawned
process starts with its parent's CPU mask (in the server's engine process: the one CPU libgomp bound
its main thread to). So the rank's CPUs are set here before anything imports torch, and the
arguments that would import it when unpickled (the model info, the dtype) arrive as bytes,
unpickled only after that.
"""
from __future__ import annotations

import os
import pickle


def main(rank: int, cpus: tuple[int, ...] | None, payload: bytes, conn) -> None:
    if cpus:
        try:
            os.sched_setaffinity(0, set(cpus))
        except OSError:  # a cpuset that forbids them: worker_startup reports where the threads run
            pass
    from appliance.distributed.executor import worker_main

    worker_main(rank, conn, *pickle.loads(payload))
