"""How ``auto`` compares linear backends: interleaved rounds, each batch size counted alike."""
from __future__ import annotations

import os

import pytest

from appliance.layers import linear


@pytest.fixture(autouse=True, scope="module")
def _native_loaded():
    """The native kernels loaded (or found missing) from the real cache dir once, before tests here
    point APPLIANCE_CACHE_DIR at a temporary folder for the choices' cache: a first load from there
    would find no build and be remembered for the process."""
    from appliance.ops import native

    native.is_available()


def _fake(times: dict[tuple[str, int], list[float]], calls: list):
    """fns and a timer: each call of fns[c][m] is answered by the next of times[(c, m)]."""
    fns = {}
    for (c, m) in times:
        fns.setdefault(c, {})[m] = (c, m)
    left = {k: list(v) for k, v in times.items()}

    def timer(f):
        calls.append(f)
        return left[f].pop(0)

    return fns, timer


def test_every_batch_size_counts_alike():
    # B is 10% faster at 256 rows, A twice as fast at one row: a raw sum of seconds (102 vs 111)
    # would pick B; relative to the fastest at each size, A costs 1 + 1.1 and B 2 + 1.
    r = linear._ROUNDS
    calls = []
    fns, timer = _fake({("A", 1): [1.0] * r, ("A", 256): [110.0] * r,
                        ("B", 1): [2.0] * r, ("B", 256): [100.0] * r}, calls)
    cost = linear.relative_cost(fns, timer)
    assert abs(cost["A"] - 2.1) < 1e-9 and abs(cost["B"] - 3.0) < 1e-9
    assert min(cost, key=cost.get) == "A"


def test_rounds_are_interleaved_and_keep_each_best():
    # The machine slows down from one round to the next: timing A's rounds before B's would blame
    # B for it. Interleaved, each keeps its best (first-round) time and equal kernels tie.
    r = linear._ROUNDS
    assert r >= 2
    calls = []
    slow = [1.0 * (1 + i) for i in range(r)]
    fns, timer = _fake({("A", 8): list(slow), ("B", 8): list(slow)}, calls)
    cost = linear.relative_cost(fns, timer)
    assert calls == [("A", 8), ("B", 8)] * r
    assert cost == {"A": 1.0, "B": 1.0}


def test_speculative_verify_rows_are_timed_and_cached_apart(tmp_path, monkeypatch):
    """``extra_rows`` (speculative decoding's 1 + k chunk) joins the probe batch sizes, and its choice
    is cached under its own key, so a plain engine's cached choice is neither reused nor overwritten."""
    import json

    import torch
    from torch import nn

    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    seen = []

    def measure(self, cands, rows, timer):
        seen.append(tuple(rows))
        # the last candidate wins when the verify size is timed, the first otherwise
        return {c: (-i if 6 in rows else i) for i, c in enumerate(cands)}

    monkeypatch.setattr(linear.Linear, "measure", measure)
    lin = linear.Linear(64, 32)
    cands = lin.candidates(torch.float32, torch.device("cpu"))
    if len(cands) < 2:
        import pytest

        pytest.skip(f"one float backend on this host ({cands}): nothing is measured")
    linear.select_backends(nn.Sequential(lin), "auto", torch.float32, torch.device("cpu"))
    plain = lin.backend
    linear.select_backends(nn.Sequential(lin), "auto", torch.float32, torch.device("cpu"), (6,))
    assert seen == [linear._PROBE_ROWS, tuple(sorted({*linear._PROBE_ROWS, 6}))]
    assert (plain, lin.backend) == (cands[0], cands[-1])
    cache = json.loads((tmp_path / "linear_backends.json").read_text())
    rows_key = "|rows" + "-".join(map(str, sorted({*linear._PROBE_ROWS, 6}))) + "|"
    assert sorted(v for k, v in cache.items() if rows_key in k) == [cands[-1]]
    assert sorted(v for k, v in cache.items() if rows_key not in k) == [cands[0]]


def test_a_hopeless_candidate_is_timed_one_round_only():
    # C scores 3 + 20 after the first round against A's 1 + 1 (more than _HOPELESS times it): it
    # cannot win, and its slow calls are not repeated; A and B (within 3x) get every round.
    r = linear._ROUNDS
    calls = []
    fns, timer = _fake({("A", 1): [1.0] * r, ("A", 256): [10.0] * r,
                        ("B", 1): [2.0] * r, ("B", 256): [12.0] * r,
                        ("C", 1): [3.0], ("C", 256): [200.0]}, calls)
    cost = linear.relative_cost(fns, timer)
    assert calls.count(("C", 256)) == 1 and calls.count(("C", 1)) == 1
    assert calls.count(("A", 256)) == r and calls.count(("B", 1)) == r
    assert min(cost, key=cost.get) == "A" and cost["C"] > linear._HOPELESS * cost["A"]


def test_a_candidate_within_the_margin_keeps_every_round():
    # B is 2.5x slower in the first round (a noisy moment) and fastest afterwards: it is kept and wins
    r = linear._ROUNDS
    calls = []
    fns, timer = _fake({("A", 8): [1.0] * r, ("B", 8): [2.5] + [0.5] * (r - 1)}, calls)
    cost = linear.relative_cost(fns, timer)
    assert calls.count(("B", 8)) == r and min(cost, key=cost.get) == "B"


def test_layers_of_one_shape_with_other_candidates_are_chosen_apart(tmp_path, monkeypatch):
    """Two layers of one shape whose stored formats allow other methods (a GGUF mix: a q/k/v with a
    Q8_0 v beside all-Q5_0 ones) are chosen each over its own candidates: the first one's choice is
    never handed to the other (it may not even run there)."""
    import pytest
    import torch
    from torch import nn

    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear.Linear, "measure", lambda self, cands, rows, timer: {c: i for i, c in enumerate(cands)})
    a, b = linear.Linear(64, 32), linear.Linear(64, 32)
    cands = a.candidates(torch.float32, torch.device("cpu"))
    if len(cands) < 2:
        pytest.skip(f"one float backend on this host ({cands}): nothing is measured")
    only = cands[-1]
    b.candidates = lambda dtype, device: [only]  # b can run one method only, not a's choice
    report = linear.select_backends(nn.Sequential(a, b), "auto", torch.float32, torch.device("cpu"))
    assert (a.backend, b.backend) == (cands[0], only)
    assert report == {"64x32": cands[0], f"64x32 [{only}]": only}
    # and the other way round: the restricted layer first does not decide for the free one
    c, d = linear.Linear(64, 32), linear.Linear(64, 32)
    c.candidates = lambda dtype, device: [only]
    linear.select_backends(nn.Sequential(c, d), "auto", torch.float32, torch.device("cpu"))
    assert (c.backend, d.backend) == (only, cands[0])


def test_the_timing_scratch_is_released_after_the_choice(tmp_path, monkeypatch):
    """Timing writes a 64 MiB scratch between calls (``_evict_caches``); it is freed once the layers
    are chosen, not left resident beside the weights for the process's life (issue 14: a cold load
    held it)."""
    import torch
    from torch import nn

    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    during = []

    def measure(self, cands, rows, timer):
        timer(lambda: None)  # linear._time: evicts the caches before each timed call
        during.append(linear._SCRATCH is not None and linear._SCRATCH.numel())
        return {c: i for i, c in enumerate(cands)}

    lin = linear.Linear(64, 32)
    first = lin.candidates(torch.float32, torch.device("cpu"))[0]
    # two candidates (the host may have one float backend): the choice is timed, not taken
    monkeypatch.setattr(linear.Linear, "candidates", lambda self, dtype, device: [first, first])
    monkeypatch.setattr(linear.Linear, "measure", measure)
    linear.select_backends(nn.Sequential(lin), "auto", torch.float32, torch.device("cpu"))
    assert during == [64 << 20] and lin.backend == first
    assert linear._SCRATCH is None


def test_within_the_margin_the_fewest_bytes_win():
    """Candidates within ``_MEMORY_MARGIN`` of the fastest count as equally fast; of those the one
    holding the fewest bytes runs (ties: the faster). Beyond the margin, or without sizes, speed alone."""
    m = linear._MEMORY_MARGIN
    assert 0 < m <= 0.15
    held = {"int8": 125, "5bit": 81, "6bit": 94}
    assert linear.choose({"int8": 3.0, "5bit": 3.0 * (1 + m * 0.9), "6bit": 3.05}, held) == "5bit"
    assert linear.choose({"int8": 3.0, "5bit": 3.0 * (1 + m * 1.1), "6bit": 3.05}, held) == "6bit"
    assert linear.choose({"int8": 3.0, "5bit": 3.0 * (1 + m * 1.1), "6bit": 3.0 * (1 + m * 1.1)}, held) == "int8"
    assert linear.choose({"int8": 3.0, "5bit": 3.1, "6bit": 3.05}, {}) == "int8"
    assert linear.choose({"a": 3.1, "b": 3.0}, {"a": 10, "b": 10}) == "b"
    assert linear.choose({"a": -1.0, "b": -2.0}, {"a": 1, "b": 2}) == "b"  # margin of |best|: -2.2 < -1


def test_a_q5_layer_timed_alike_keeps_its_5_bit_form(tmp_path, monkeypatch):
    """A GGUF Q5_0-style layer (values in [-16, 15], groups of 32) whose candidates time alike is held
    by the candidate whose real packing is smallest: the 5-bit one where the host runs it, not int8
    (issue 14: a cold load's timing picked int8 for gate_up, 1.25 B/weight against 0.81)."""
    import torch
    from torch import nn

    from appliance.layers import quant

    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(quant, "relative_cost", lambda fns, timer: {c: 3.0 for c in fns})  # a tie
    k, n, g = 256, 64, 32
    lin = quant.QuantLinear(k, n, "w8a8", g, w8_groups=True)
    lin.qweight.data = torch.randint(-16, 16, (n, k), dtype=torch.int8)
    lin.weight_scale.data = torch.rand(n, k // g) * 0.01 + 1e-3
    if lin.weight_zero_point is not None:
        lin.weight_zero_point.data.zero_()
    cands = lin.candidates(torch.float32, torch.device("cpu"))
    if len(cands) < 2:
        pytest.skip(f"one w8a8 method on this host ({cands}): nothing is chosen")
    sizes = {}
    for c in cands:
        sizes[c] = quant.packed_bytes(quant.pack(c, lin.qweight.data, lin.weight_scale.data, lin._zp()))
    linear.select_backends(nn.Sequential(lin), "auto", torch.float32, torch.device("cpu"))
    assert lin.backend == min(sizes, key=sizes.get), (lin.backend, sizes)
    if "w5a8_native" in cands:
        assert lin.backend == "w5a8_native" and sizes["w5a8_native"] < 0.7 * sizes["w8a8_native"], sizes


# ---- re-timing choices made on a busy host -----------------------------------------------------------


def scripted_host_load(monkeypatch, shares: list[float]):
    """The share of the CPUs other processes take during each of select_backends' timing windows:
    ``shares`` in turn, the last one repeated (in place of runtime.host_load's /proc/stat reading)."""
    from appliance.runtime import host_load

    left = list(shares)

    class Scripted:
        def __init__(self, *a, **k):
            self.share = 0.0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.share = left.pop(0) if len(left) > 1 else left[0]

    monkeypatch.setattr(host_load, "OthersLoad", Scripted)



def _two_candidates(monkeypatch, tmp_path, costs: list[tuple[float, float]]):
    """A 64x32 layer factory whose two candidates (the host's first two float methods) cost
    ``costs[i]`` at the i-th timing; returns (make_layer, candidates, calls, select)."""
    import torch
    from torch import nn

    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))
    cands = linear.float_candidates(torch.float32, torch.device("cpu"))
    if len(cands) < 2:
        pytest.skip(f"one float backend on this host ({cands}): nothing is measured")
    a, b = cands[:2]
    monkeypatch.setattr(linear.Linear, "candidates", lambda self, dtype, device: [a, b])
    calls = []

    def measure(self, cs, rows, timer):
        ca, cb = costs[min(len(calls), len(costs) - 1)]
        calls.append(1)
        return {a: ca, b: cb}

    monkeypatch.setattr(linear.Linear, "measure", measure)

    def select():
        lin = linear.Linear(64, 32)
        linear.select_backends(nn.Sequential(lin), "auto", torch.float32, torch.device("cpu"))
        return lin.backend

    return (a, b), calls, select


def _meta(tmp_path) -> dict:
    import json

    return json.loads((tmp_path / "linear_backends.json").read_text()).get(linear._META, {})


def test_a_busy_narrow_choice_is_retimed_and_a_quiet_timing_makes_it_final(tmp_path, monkeypatch):
    """Timed while others took half the CPUs, with the runner-up 10% behind (under _FRAGILE), the
    choice is provisional: the next start times it again; that timing, on a quiet host, is final."""
    scripted_host_load(monkeypatch, [0.5, 0.0])
    (a, b), calls, select = _two_candidates(monkeypatch, tmp_path, [(5.0, 5.5), (5.5, 5.0)])
    assert select() == a and len(calls) == 1
    (rec,) = _meta(tmp_path).values()
    assert rec == {"tries": 0, "busy": 0.5, "margin": 0.1}
    assert select() == b and len(calls) == 2  # re-timed, and the quiet timing's choice is used
    assert _meta(tmp_path) == {}
    assert select() == b and len(calls) == 2  # final: read from the cache


def test_a_large_margin_on_a_moderately_busy_host_is_final(tmp_path, monkeypatch):
    busy = (linear._BUSY + linear._SATURATED) / 2
    scripted_host_load(monkeypatch, [busy])
    lead = 1 + linear._FRAGILE * 1.5
    (a, b), calls, select = _two_candidates(monkeypatch, tmp_path, [(5.0, 5.0 * lead)])
    assert select() == a and select() == a and len(calls) == 1
    assert _meta(tmp_path) == {}


def test_on_a_saturated_host_even_a_large_margin_is_provisional(tmp_path, monkeypatch):
    """Timings with others holding _SATURATED of the CPUs or more are biased, by large margins (torch
    picked by up to 1763% where a quiet host picks native, bench/results/retime.txt): no margin makes
    them final; the quiet re-timing does."""
    assert linear._BUSY < linear._SATURATED <= 1
    scripted_host_load(monkeypatch, [linear._SATURATED, 0.0])
    (a, b), calls, select = _two_candidates(monkeypatch, tmp_path, [(5.0, 50.0), (50.0, 5.0)])
    assert select() == a and [r["tries"] for r in _meta(tmp_path).values()] == [0]
    assert select() == b and select() == b and len(calls) == 2 and _meta(tmp_path) == {}


def test_a_quiet_narrow_choice_is_final(tmp_path, monkeypatch):
    scripted_host_load(monkeypatch, [linear._BUSY * 0.5])
    (a, b), calls, select = _two_candidates(monkeypatch, tmp_path, [(5.0, 5.1)])
    assert select() == a and select() == a and len(calls) == 1


def test_an_always_busy_host_retimes_a_few_times_then_keeps_the_choice(tmp_path, monkeypatch):
    """Every timing busy and narrow: re-timed at _RETIMES starts after the first, then kept for good."""
    scripted_host_load(monkeypatch, [0.9])
    (a, b), calls, select = _two_candidates(monkeypatch, tmp_path, [(5.0, 5.2)])
    assert 1 <= linear._RETIMES <= 5
    for i in range(linear._RETIMES):
        select()
        assert [r["tries"] for r in _meta(tmp_path).values()] == [i]
    assert select() == a and len(calls) == 1 + linear._RETIMES and _meta(tmp_path) == {}
    for _ in range(3):
        assert select() == a
    assert len(calls) == 1 + linear._RETIMES


def test_an_old_cache_file_without_records_still_loads_and_is_used(tmp_path, monkeypatch):
    """A file written before provisional records (plain {key: backend}) is read as it is: its choices
    are final, used without timing, even on a busy host; a stray malformed record is ignored."""
    import json

    scripted_host_load(monkeypatch, [0.0, 0.9])  # written quiet (final); busy from then on
    (a, b), calls, select = _two_candidates(monkeypatch, tmp_path, [(5.0, 50.0)])
    select()
    path = tmp_path / "linear_backends.json"
    (key,) = json.loads(path.read_text())
    path.write_text(json.dumps({key: b}))  # the old format, choosing the other method
    assert select() == b and len(calls) == 1
    path.write_text(json.dumps({key: b, linear._META: {key: "garbage"}}))
    assert select() == b and len(calls) == 1


def test_margin_is_the_nearest_other_candidates_gap_relative_to_the_choice():
    assert linear.margin({"a": 5.0, "b": 5.5, "c": 9.0}, "a") == pytest.approx(0.1)
    # chosen for its bytes within _MEMORY_MARGIN: the faster one is the nearest competitor
    assert linear.margin({"int8": 5.0, "5bit": 5.25}, "5bit") == pytest.approx(0.25 / 5.25)
    assert linear.margin({"a": 5.0}, "a") == float("inf")


def _stat(ticks: dict[str, list[int]]) -> str:
    return "".join(f"{n} {' '.join(map(str, v))}\n" for n, v in ticks.items()) + "\nintr 1 2 3\nctxt 99\n"


def test_others_load_from_a_synthetic_proc_stat():
    """Busy ticks (user nice system irq softirq steal; not idle or iowait) on the usable CPUs, less
    this process's own CPU time, over wall time x usable CPUs."""
    import os

    from appliance.runtime.host_load import OthersLoad

    hz = os.sysconf("SC_CLK_TCK")
    #            user     nice system   idle   iowait irq softirq steal guest gnice
    before = {"cpu": [0] * 10, "cpu0": [10, 0, 5, 100, 3, 0, 0, 0, 0, 0],
              "cpu1": [20, 0, 5, 100, 3, 0, 0, 0, 0, 0], "cpu2": [0] * 10}
    # over 1 s: cpu0 +1.5 s busy (user 1 s, system 0.25 s, irq/softirq/steal 0.25 s), cpu1 +0.5 s
    # (nice), cpu2 (not usable) fully busy; idle and iowait grow too, guest is inside user
    after = {"cpu": [0] * 10,
             "cpu0": [10 + hz, 0, 5 + hz // 4, 100 + 7 * hz, 3 + 5 * hz, hz // 12, hz // 12, hz // 12, hz, 0],
             "cpu1": [20, hz // 2, 5, 100 + hz, 3, 0, 0, 0, 0, 0], "cpu2": [hz, 0, 0, 0, 0, 0, 0, 0, 0, 0]}
    busy = (hz + hz // 4 + 3 * (hz // 12) + hz // 2) / hz
    texts, own, clock = [_stat(before), _stat(after)], [10.0, 10.5], [100.0, 101.0]
    with OthersLoad([0, 1], read=lambda: texts.pop(0), own=lambda: own.pop(0), clock=lambda: clock.pop(0)) as load:
        pass
    assert load.share == pytest.approx((busy - 0.5) / 2)
    assert 0.6 < load.share < 0.8
    # this process's own time is not others' load: all of it ours -> 0 (never negative)
    texts, own, clock = [_stat(before), _stat(after)], [0.0, 5.0], [0.0, 1.0]
    with OthersLoad([0, 1], read=lambda: texts.pop(0), own=lambda: own.pop(0), clock=lambda: clock.pop(0)) as load:
        pass
    assert load.share == 0.0
    # a CPU missing from the per-CPU lines (a container's numbering): the all-CPU line, over all CPUs
    agg_b, agg_a = {"cpu": [0] * 10, "cpu0": [0] * 10, "cpu1": [0] * 10}, {"cpu": [hz] + [0] * 9,
                                                                            "cpu0": [0] * 10, "cpu1": [0] * 10}
    texts, own, clock = [_stat(agg_b), _stat(agg_a)], [0.0, 0.0], [0.0, 1.0]
    with OthersLoad([7], read=lambda: texts.pop(0), own=lambda: own.pop(0), clock=lambda: clock.pop(0)) as load:
        pass
    assert load.share == pytest.approx(0.5)


def test_without_proc_stat_the_host_counts_as_quiet():
    from appliance.runtime.host_load import OthersLoad

    clock = [0.0, 1.0]
    with OthersLoad([0, 1], read=lambda: None, own=lambda: 0.0, clock=lambda: clock.pop(0)) as load:
        pass
    assert load.share == 0.0


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat on this OS: covered by the test above")
def test_the_real_proc_stat_parses_for_the_engine_cpus():
    """This host's /proc/stat (read directly: the suite's runs read no /proc/stat) has a line for
    every CPU the engine may use, and OthersLoad over a real window gives a share in [0, 1]."""
    from appliance.runtime import host_load
    from appliance.runtime.threads import engine_cpus

    with open("/proc/stat") as f:
        text = f.read()
    ticks, n = host_load.busy_ticks(text, engine_cpus())
    assert ticks > 0 and n == len(engine_cpus())
    with host_load.OthersLoad(read=lambda: open("/proc/stat").read()) as load:
        sum(i * i for i in range(200_000))
    assert 0.0 <= load.share <= 1.0
