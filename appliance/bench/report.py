"""Rich tables for each bench record, and the latency / throughput vs concurrency plot."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()
if not console.is_terminal:  # piped or captured: do not fold the wide tables at 80 columns
    console = Console(width=200)


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _num(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _dist(d: dict) -> str:
    return f"{_ms(d['mean'])} / {_ms(d['p50'])} / {_ms(d['p90'])} / {_ms(d['p99'])}"


def _machine_line(rec: dict) -> str:
    m = rec["machine"]
    return (f"{m['cpu']} ({m['arch']}), {m['torch_threads']} torch threads, {m['logical_cpus']} CPUs, "
            f"torch {m['torch']}, allocator {m['allocator']}")


def serve_table(levels: list[dict], title: str) -> Table:
    t = Table(title=title)
    for col in ("conc", "rate/s", "ok", "failed", "req/s", "out tok/s", "total tok/s",
                "TTFT ms mean/p50/p90/p99", "TPOT ms", "ITL ms", "E2E ms"):
        t.add_column(col, justify="right")
    for lv in levels:
        t.add_row(_num(lv["concurrency"], "d"), _num(lv["request_rate"], ".2f"), str(lv["completed"]),
                  f"[red]{lv['failed']}[/red]" if lv["failed"] else "0", _num(lv["request_throughput"], ".2f"),
                  _num(lv["output_throughput"]), _num(lv["total_token_throughput"]), _dist(lv["ttft_s"]),
                  _dist(lv["tpot_s"]), _dist(lv["itl_s"]), _dist(lv["e2e_s"]))
    return t


def _print_errors(levels: list[dict]) -> None:
    for lv in levels:
        if lv["failed"]:
            where = f"concurrency {lv['concurrency']}" if lv["concurrency"] else f"rate {lv['request_rate']}/s"
            console.print(f"[red]{lv['failed']} of {lv['num_requests']} failed at {where}:[/red] "
                          + escape("; ".join(lv["errors"])))


def print_record(rec: dict) -> None:
    r, bench = rec["results"], rec["bench"]
    console.print(f"[dim]{_machine_line(rec)}[/dim]")
    if bench == "throughput":
        t = Table(title="offline throughput")
        for col in ("requests", "in tokens", "out tokens", "elapsed s", "req/s", "in tok/s", "out tok/s",
                    "total tok/s", "forward share"):
            t.add_column(col, justify="right")
        e = r["engine"]
        t.add_row(str(r["num_requests"]), str(r["input_tokens"]), str(r["output_tokens"]), f"{r['elapsed_s']:.2f}",
                  f"{r['requests_per_s']:.2f}", f"{r['input_tokens_per_s']:.1f}", f"{r['output_tokens_per_s']:.1f}",
                  f"{r['total_tokens_per_s']:.1f}", f"{e['forward_s'] / e['step_s']:.1%}" if e["step_s"] else "-")
    elif bench == "latency":
        t = Table(title=f"latency: batch {r['batch_size']}, {r['input_len']} in / {r['output_len']} out, "
                        f"{r['repeats']} repeats (ms)")
        for col in ("metric", "mean", "p50", "p90", "p99"):
            t.add_column(col, justify="right")
        for name, key in (("time to first token", "ttft_s"), ("per-token (decode step)", "tpot_s"),
                          ("end to end", "e2e_s")):
            d = r[key]
            t.add_row(name, _ms(d["mean"]), _ms(d["p50"]), _ms(d["p90"]), _ms(d["p99"]))
    elif bench == "serve":
        console.print(serve_table(r["levels"], f"serve: {r['base_url']} ({r['model']}, {r['endpoint']})"))
        _print_errors(r["levels"])
        return
    elif bench == "profile":
        t = Table(title=f"profile: {r['wall_s']:.2f} s, {r['steps']} steps, {r['output_tokens']} output tokens")
        t.add_column("where", justify="left")
        t.add_column("seconds", justify="right")
        t.add_column("share", justify="right")
        for b in r["buckets"]:
            t.add_row(b["name"], f"{b['seconds']:.3f}", f"{b['fraction']:.1%}")
        console.print(t)
        t = Table(title="top ops (self CPU time)")
        for col in ("op", "self s", "calls"):
            t.add_column(col, justify="right")
        for o in r["top_ops"]:
            t.add_row(o["name"], f"{o['self_s']:.3f}", str(o["calls"]))
        console.print(t)
        pf, cs, th = r["page_faults"], r["context_switches"], r["threads"]
        console.print(f"page faults: {pf['minor']} minor, {pf['major']} major | context switches: "
                      f"{cs['voluntary']} voluntary, {cs['involuntary']} involuntary | threads: {th['process']} in "
                      f"process, torch {th['torch_intra_op']} intra-op / {th['torch_inter_op']} inter-op")
        console.print(f"allocator: {r['allocator']} | libgomp: {r['libgomp']}"
                      + (f" | trace: {r['trace_file']}" if r["trace_file"] else ""))
        return
    elif bench == "kernels":
        console.print(f"limits: peak GEMM {r['peak_gemm_gflops']:.1f} GFLOP/s ({r['dtype']}), memory bandwidth "
                      f"{r['memory_bandwidth_gbps']:.1f} GB/s (copy, read+write)")
        t = Table(title="GEMM (y = x W^T)")
        for col in ("backend", "layer", "phase", "M", "N", "K", "us", "GFLOP/s", "roofline", "% roofline", "% peak"):
            t.add_column(col, justify="right")
        for g in r["gemm"]:
            t.add_row(g["backend"], g["layer"], g["phase"], str(g["m"]), str(g["n"]), str(g["k"]),
                      f"{g['seconds'] * 1e6:.1f}", f"{g['gflops']:.1f}", f"{g['roofline_gflops']:.1f}",
                      f"{g['fraction_of_roofline']:.0%}", f"{g['fraction_of_peak']:.0%}")
        console.print(t)
        t = Table(title="decode paged attention (KV bytes read / time)")
        for col in ("backend", "batch", "context", "us", "GB/s", "% bandwidth"):
            t.add_column(col, justify="right")
        for a in r["attention"]:
            t.add_row(a["backend"], str(a["batch"]), str(a["context"]), f"{a['seconds'] * 1e6:.1f}",
                      f"{a['gbps']:.1f}", f"{a['fraction_of_bandwidth']:.0%}")
    elif bench == "compare":
        for s in r["systems"]:
            if s["status"] == "ran":
                console.print(serve_table(s["levels"], s["name"]))
                _print_errors(s["levels"])
            else:
                console.print(f"[yellow]{s['name']}: {s['status']}[/yellow] ({escape(s['reason'] or '')})")
        t = Table(title="appliance / peer (throughput > 1 and latency < 1 favour the appliance)")
        for col in ("peer", "conc", "out tok/s ratio", "TTFT p50 ratio", "TPOT p50 ratio"):
            t.add_column(col, justify="right")
        for x in r["ratios"]:
            t.add_row(x["peer"], str(x["concurrency"]), _num(x["output_throughput"], ".2f"),
                      _num(x["ttft_p50"], ".2f"), _num(x["tpot_p50"], ".2f"))
        if not r["ratios"]:
            t.add_row("(no peer ran)", "-", "-", "-", "-")
    else:
        raise ValueError(f"unknown bench {bench!r}")
    console.print(t)


def plot(series: dict[str, list[dict]], path: str, title: str) -> None:
    """Output throughput, TTFT p50 and TPOT p50 against concurrency, one line per system."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'appliance[bench]'") from e
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("output tokens/s", lambda lv: lv["output_throughput"]),
              ("TTFT p50 (ms)", lambda lv: None if lv["ttft_s"]["p50"] is None else lv["ttft_s"]["p50"] * 1e3),
              ("TPOT p50 (ms)", lambda lv: None if lv["tpot_s"]["p50"] is None else lv["tpot_s"]["p50"] * 1e3))
    for ax, (label, get) in zip(axes, panels):
        for name, levels in series.items():
            pts = [(lv["concurrency"], get(lv)) for lv in levels if lv["concurrency"] and get(lv) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ticks = sorted({lv["concurrency"] for levels in series.values() for lv in levels if lv["concurrency"]})
        if ticks:
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
