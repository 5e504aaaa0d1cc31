"""How rank 0 should hand each step's schedule to the other tensor-parallel ranks: a pipe per
worker (pickled once, ``send_bytes``; what ``appliance.distributed.executor`` does) against gloo's
``broadcast_object`` (two collectives: size, then bytes), with 2 ranks on loopback, for a decode
step of 1, 16 and 256 requests. Each round trip includes the worker's reply (a pipe ack; a gloo
barrier), so both include one return trip. Prints a table and, with ``--json``, a record:

    .venv/bin/python bench/bench_tp_message.py [--reps 200] [--json bench/results/tp_message.json]

Not a timed test.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = ((1, 4), (16, 64), (256, 64))  # (requests, blocks each)


def message(num_reqs: int, num_blocks: int) -> tuple:
    """A decode step as executor.encode_schedule builds it: one new token per request."""
    return ("execute", [(100 + i, [7], list(range(i * num_blocks, (i + 1) * num_blocks)), 101 + i)
                        for i in range(num_reqs)], num_reqs, [])


def _worker(conn, port: int, reps: int) -> None:
    from appliance.distributed.communicator import GlooCommunicator
    from appliance.distributed.parallel_state import gloo_group

    comm = GlooCommunicator(gloo_group(1, 2, "127.0.0.1", port, 120), 1, 2)
    for _ in SIZES:
        for _ in range(reps):
            pickle.loads(conn.recv_bytes())
            conn.send_bytes(b"k")
        for _ in range(reps):
            comm.broadcast_object(None, 0)
            comm.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from appliance.distributed.communicator import GlooCommunicator
    from appliance.distributed.parallel_state import gloo_group, new_store

    store = new_store(2, timeout_s=120)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_worker, args=(there, store.port, args.reps))
    p.start()
    comm = GlooCommunicator(gloo_group(0, 2, "127.0.0.1", store.port, 120, store=store), 0, 2)
    rows = []
    for num_reqs, num_blocks in SIZES:
        msg = message(num_reqs, num_blocks)
        t = time.perf_counter()
        for _ in range(args.reps):
            here.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
            here.recv_bytes()
        pipe_us = (time.perf_counter() - t) / args.reps * 1e6
        t = time.perf_counter()
        for _ in range(args.reps):
            comm.broadcast_object(msg, 0)
            comm.barrier()
        gloo_us = (time.perf_counter() - t) / args.reps * 1e6
        rows.append(dict(requests=num_reqs, blocks=num_blocks, bytes=len(pickle.dumps(msg)), pipe_us=round(pipe_us, 1),
                         broadcast_object_us=round(gloo_us, 1)))
    p.join(60)
    print(f"{'requests':>8} {'bytes':>7} {'pipe us':>9} {'gloo broadcast_object us':>25}")
    for r in rows:
        print(f"{r['requests']:>8} {r['bytes']:>7} {r['pipe_us']:>9} {r['broadcast_object_us']:>25}")
    if args.json:
        args.json.write_text(json.dumps({"bench": "tp_message", "reps": args.reps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
