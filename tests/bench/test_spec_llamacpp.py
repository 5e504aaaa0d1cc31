"""bench spec's llama.cpp side: which file llama.cpp runs (each system at the weights the appliance runs) and
the llama-server arguments of each setting (its own n-gram lookup and its draft model)."""
from __future__ import annotations

import pytest

from appliance.bench import llamacpp
from appliance.bench.spec import LLAMACPP_NGRAM_N, add_ratios, llamacpp_target_gguf, run_llamacpp
from appliance.models.default_model import default_gguf_path


def test_native_quant_target_is_the_gguf_itself(tmp_path):
    gguf = str(default_gguf_path())
    assert llamacpp_target_gguf(gguf, "gguf") == gguf
    assert llamacpp_target_gguf(None, "gguf") == gguf  # the embedded default model
    # a float checkpoint has no file of its own quant to give llama.cpp
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="quantization gguf: the target must be a .gguf file"):
        llamacpp_target_gguf(str(tmp_path), "gguf")


def test_settings_and_their_server_arguments(monkeypatch):
    calls = []

    def fake_run(model, threads, prompts, gen_len, parallel, extra_args, ignore_eos):
        assert not ignore_eos  # each request ends at its end of turn, as the appliance's do
        calls.append((model, threads, parallel, list(extra_args)))
        spec = "--spec-type" in extra_args
        return {"command": ["llama-server", *extra_args],
                "runs": [{"predicted_per_second": 30.0 + 10 * spec, "predicted_n": 8, "wall_s": 1.0,
                          "draft_n": 6 if spec else 0, "draft_n_accepted": 3 if spec else 0} for _ in prompts]}

    monkeypatch.setattr(llamacpp, "is_built", lambda *a, **k: True)
    monkeypatch.setattr(llamacpp, "llama_server_run", fake_run)
    prompts = {"edit": [1, 2, 3], "chat": [4, 5]}
    rows = run_llamacpp("target.gguf", "draft.gguf", prompts, 8, k=3, threads=2, log=lambda m: None)
    assert [c[3] for c in calls] == [
        [],
        ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(LLAMACPP_NGRAM_N),
         "--spec-ngram-simple-size-m", "3"],
        ["--spec-type", "draft-simple", "-md", "draft.gguf", "--spec-draft-n-max", "3", "--spec-draft-n-min", "0",
         "-td", "2"]]
    assert all(c[0] == "target.gguf" and c[2] == 1 for c in calls)  # batch 1, the same target
    assert [(r["setting"], r["workload"]) for r in rows] == [
        (s, w) for s in ("llama.cpp", "llama.cpp+ngram", "llama.cpp+draft") for w in ("edit", "chat")]
    assert [r.get("acceptance_rate") for r in rows] == [None, None, 0.5, 0.5, 0.5, 0.5]
    # speedups over llama.cpp's own plain rows; the best-setting line takes its fastest
    rows.append({"setting": "none", "workload": "edit", "concurrency": 1, "decode_tok_s": 60.0})
    lines = add_ratios(rows)
    assert rows[2]["speedup"] == pytest.approx(40 / 30)
    assert lines == ["edit  c=1 best: appliance none 60.0 tok/s vs llama.cpp+ngram 40.0 tok/s: 1.50x"]
    # without --draft and with ngram off: the plain row alone
    calls.clear()
    run_llamacpp("target.gguf", None, prompts, 8, k=3, threads=2, log=lambda m: None, ngram=False)
    assert [c[3] for c in calls] == [[]]


def test_llama_tools_start_with_a_shells_cpus_and_environment(monkeypatch, tmp_path):
    """Under `appliance bench` libgomp has bound the bench's thread to one CPU and the environment holds
    the bench's own OpenMP placement; a llama.cpp tool started from it inherited both (llama-server ran
    all its threads on one CPU). It must start with the CPUs the bench was given and without them."""
    import json
    import os

    allowed = sorted(os.sched_getaffinity(0))
    fake = tmp_path / "llama-bench"
    # prints, as llama-bench's JSON, the CPUs it may run on and the OpenMP placement it was given
    fake.write_text('#!/bin/bash\ncpus=$(grep Cpus_allowed_list /proc/self/status | cut -f2)\n'
                    'echo "[{\\"cpus\\": \\"$cpus\\", \\"omp_places\\": \\"${OMP_PLACES:-}\\"}]"\n')
    fake.chmod(0o755)
    monkeypatch.setattr(llamacpp, "tool", lambda name, *a: fake)
    monkeypatch.setenv("OMP_PLACES", "{0}")  # what the bench process runs under
    monkeypatch.setenv("APPLIANCE_BENCH_PARENT_ENV", json.dumps({"OMP_PLACES": None}))
    monkeypatch.setenv("APPLIANCE_BENCH_CPUS", ",".join(map(str, allowed)))
    os.sched_setaffinity(0, {allowed[0]})  # as libgomp leaves the bench's thread
    try:
        rows, _ = llamacpp.llama_bench("model.gguf", 2, 8, 8, 1)
        assert os.sched_getaffinity(0) == {allowed[0]}  # the caller's own mask is put back
    finally:
        os.sched_setaffinity(0, set(allowed))
    assert rows[0]["omp_places"] == ""
    from appliance.runtime.threads import parse_cpu_list

    assert parse_cpu_list(rows[0]["cpus"]) == allowed
