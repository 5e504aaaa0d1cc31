"""``appliance bench compare``: one workload against the appliance and then each installed peer
(vLLM's CPU build, llama.cpp's server), one server at a time so they never share the CPU, and the
appliance's ratios to each peer."""
from __future__ import annotations

from appliance.bench.loadgen import LoadConfig, fetch_model, sweep
from appliance.bench.servers import Peer, ServerProcess


def run_system(name: str, command: list[str], prompts: list, concurrencies: list[int], output_len: int,
               num_prompts: int | None, endpoint: str, warmup: int, progress=None, api_key: str | None = None,
               startup_timeout: float = 600, env: dict | None = None, extra_body: dict | None = None) -> dict:
    """Start one server (``env``: its extra environment), sweep it (``extra_body``: fields every request
    carries), stop it. Keys of one ``results.systems`` entry of the schema."""
    entry = {"name": name, "status": "ran", "reason": None, "command": command, "levels": []}
    try:
        with ServerProcess(command, env=env, api_key=api_key, startup_timeout=startup_timeout) as srv:
            # as a shell would run it: the environment it was given, then the command
            entry["command"] = [*(["env", *(f"{k}={v}" for k, v in env.items())] if env else []), *srv.command]
            model, _ = fetch_model(srv.base_url, api_key)
            cfg = LoadConfig(srv.base_url, model, endpoint=endpoint, output_len=output_len, api_key=api_key,
                             extra_body=dict(extra_body or {}))
            entry["levels"] = sweep(cfg, prompts, concurrencies, num_prompts=num_prompts, warmup=warmup,
                                    progress=(lambda label, n: progress(f"{name} {label}", n)) if progress else None)
    except RuntimeError as e:
        entry.update(status="failed", reason=str(e)[:1000])
    return entry


def skipped(peer: Peer) -> dict:
    return {"name": peer.name, "status": "skipped", "reason": peer.reason, "command": [], "levels": []}


def _ratio(a, b):
    return a / b if a is not None and b else None


def ratios(systems: list[dict]) -> list[dict]:
    """Appliance / peer at each concurrency both ran: >1 is better for throughput, <1 for latency."""
    base = next((s for s in systems if s["name"] == "appliance" and s["status"] == "ran"), None)
    if base is None:
        return []
    mine = {lv["concurrency"]: lv for lv in base["levels"]}
    out = []
    for s in systems:
        if s is base or s["status"] != "ran":
            continue
        for lv in s["levels"]:
            a = mine.get(lv["concurrency"])
            if a is None:
                continue
            out.append({"peer": s["name"], "concurrency": lv["concurrency"],
                        "output_throughput": _ratio(a["output_throughput"], lv["output_throughput"]),
                        "ttft_p50": _ratio(a["ttft_s"]["p50"], lv["ttft_s"]["p50"]),
                        "tpot_p50": _ratio(a["tpot_s"]["p50"], lv["tpot_s"]["p50"])})
    return out
