"""How far a loaded host moves select_backends' timing of one layer: the default model's float shapes
timed ``--trials`` times each (as ``auto`` does, ``linear.measure``), each timing with the share of the
CPUs other processes took meanwhile (``runtime.host_load``), its margin (``linear.margin``) and its pick.
Evidence for linear.py's _BUSY / _FRAGILE / _SATURATED: how large a margin a loaded timing produces.

    PYTHONPATH=. .venv/bin/python bench/bench_retime.py --trials 3
"""
from __future__ import annotations

import argparse

import torch

from appliance.layers import linear
from appliance.runtime.host_load import OthersLoad

SHAPES = [("qkv_proj", 960, 576, False), ("o_proj", 576, 576, False), ("gate_up_proj", 3072, 576, True),
          ("down_proj", 576, 1536, False)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    a = ap.parse_args()
    cands = linear.float_candidates(torch.float32, torch.device("cpu"))
    print(f"threads {torch.get_num_threads()}, candidates {cands}")
    for t in range(a.trials):
        for name, n, k, silu in SHAPES:
            w = torch.empty(n, k)
            with OthersLoad() as load:
                cost = linear.measure(w, cands, linear._PROBE_ROWS, silu_mul=silu)
            pick = linear.choose(cost)
            gap = linear.margin(cost, pick)
            print(f"trial {t} {name:13s} {n}x{k:<5d} others {load.share:4.0%}  pick {pick:7s} margin {gap:7.1%}  "
                  + ", ".join(f"{c} {v:.2f}" for c, v in sorted(cost.items(), key=lambda x: x[1])), flush=True)
    linear._release_scratch()


if __name__ == "__main__":
    main()
