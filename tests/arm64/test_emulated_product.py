"""The whole appliance on emulated Arm, not only its kernels: inside the Debian arm64 root (torch
2.10.0's aarch64 CPU wheel, the appliance's dependencies from aarch64 wheels, this checkout's sources
and its native kernels cross-built for aarch64: see tests/arm_tools.py and scripts/arm64/), under qemu
as Neoverse V2 (SVE 128, BF16, I8MM) and as Neoverse N1 (no SVE, BF16 or I8MM):

- ``appliance generate`` on the default model answers "The capital of France is" with Paris in
  float32 (native GEMM), bfloat16 (V2 only; torch's GEMM: oneDNN's bf16 GEMM through ACL takes ~3x
  longer under qemu), W8A8 (oneDNN's int8 GEMM, ACL) and W4A8 (torch's dynamic-quant int4 GEMM,
  KleidiAI). On N1, asking for oneDNN's bf16 GEMM is refused at start, naming BF16;
- ``appliance doctor --json`` reports the native kernel variant the dispatcher chose, KleidiAI,
  oneDNN's implementation (ACL), the allocator and the libgomp atomics class;
- ``appliance serve`` answers one chat request, with mimalloc live in its engine process.

Each profile's commands run once (a module fixture), the two profiles side by side (2 host cores);
the tests assert on their results. Under qemu torch runs at ~0.1-0.2 GFLOP/s, so the prompt is a
short completion, two tokens are generated, and every linear backend is named: ``auto`` would time
GEMMs of 1/32/256 rows per shape. The float lm_head of the quantized models is still chosen as under
``auto``; its choice is pre-seeded into the root's cache through ``select_backends`` itself, with
the timing replaced by a fixed preference and the host read as quiet, so that the seeded choice is
final (see ``SEED``).

Opt-in like every emulated-Arm test: APPLIANCE_ARM64_ROOTFS (``make test`` sets it)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from arm_tools import arm64_root, root_cmd, root_env, run_in_root

PROFILES = ("v2", "n1")
THREADS = "1"  # one OpenMP thread per emulated process: the two profiles share the 2 host cores
PROMPT = ["--prompt", "The capital of France is", "--max-tokens", "2", "--temperature", "0",
          "--num-threads", THREADS, "--kv-cache-memory", "0.05"]
# mode -> flags; every layer's backend named (the quantized models' float lm_head aside, see SEED)
MODES = {
    "float32": ["--dtype", "float32", "--linear-backend", "native"],
    "bfloat16": ["--dtype", "bfloat16", "--linear-backend", "torch"],
    "w8a8": ["--dtype", "float32", "--quantization", "w8a8", "--linear-backend", "w8a8_onednn"],
    "w4a8": ["--dtype", "float32", "--quantization", "w4a8", "--linear-backend", "w4a8_dynquant"],
}
# N1 has no BF16: oneDNN's bf16 GEMM is asked for and must be refused (there is no other check of it)
N1_BF16 = ["--dtype", "bfloat16", "--linear-backend", "onednn"]
LM_HEAD = {"float32": "native", "bfloat16": "torch", "w8a8": "native", "w4a8": "native"}
# What the native dispatcher offers (best first) and picks, as in tests/arm64/test_arm_harness.py
VARIANTS = {"v2": ["neon_bf16", "sve", "neon", "generic"], "n1": ["neon", "generic"]}
FEATURES = {"v2": {"asimd": True, "asimddp": True, "bf16": True, "i8mm": True, "sve": True, "sve2": True,
                   "atomics": True},
            "n1": {"asimd": True, "asimddp": True, "bf16": False, "i8mm": False, "sve": False, "sve2": False,
                   "atomics": True}}

# Run in the root before the profiles: the default model converted once into the root's cache, and
# the quantized models' float lm_head (tied embedding, 49152 x 576) given the native GEMM by
# select_backends with the measurement replaced, so the key and the file are linear.py's own.
SEED = f"""
import torch
from torch import nn
from appliance.layers import linear
from appliance.models.default_model import resolve_model
print("model", resolve_model(None))
torch.set_num_threads({THREADS})
linear.Linear.measure = lambda self, cands, rows, timer: {{c: 0.0 if c == "native" else 1.0 for c in cands}}
from appliance.runtime import host_load
host_load.read_proc_stat = lambda: None  # a quiet window: the seeded choice is final, not re-timed under qemu
print("seeded", linear.select_backends(nn.ModuleList([linear.Linear(576, 49152)]), "auto", torch.float32,
                                       torch.device("cpu")))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_and_chat(profile: str) -> dict:
    """`appliance serve` in the root, one chat request from the host (the root shares its network),
    then SIGTERM: the server must exit 0."""
    port = _free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen(root_cmd(profile, "appliance", "serve", "--host", "127.0.0.1", "--port", str(port),
                                     "--dtype", "float32", "--linear-backend", "native", "--num-threads", THREADS,
                                     "--max-model-len", "256", "--kv-cache-memory", "0.05", "--max-num-seqs", "4"),
                            env=root_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: dict = {"status": None, "body": None, "rc": None, "metrics": ""}
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(2)
        out["ready_s"] = time.monotonic() - t0
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "What is the capital of France?"}]}
        req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t1 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out["status"], out["body"] = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            out["status"], out["body"] = e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as e:
            out["body"] = f"{type(e).__name__}: {e}"
        out["request_s"] = time.monotonic() - t1
        try:
            with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
                out["metrics"] = r.read().decode()
        except (urllib.error.URLError, OSError) as e:
            out["metrics"] = f"{type(e).__name__}: {e}"
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            log, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
    out["rc"], out["log"], out["seconds"] = proc.returncode, log, time.monotonic() - t0
    return out


def _profile_runs(profile: str) -> dict:
    res: dict = {}
    r = run_in_root(profile, "appliance", "doctor", "--json")
    res["doctor"] = r
    for mode, flags in MODES.items():
        if profile == "n1" and mode == "bfloat16":
            flags = N1_BF16
        res[mode] = run_in_root(profile, "appliance", "generate", *PROMPT, *flags)
    res["serve"] = _serve_and_chat(profile)
    return res


_done: dict = {}


@pytest.fixture(scope="module")
def runs() -> dict:
    """Every profile's runs, once: a failure is remembered, not retried for each test (minutes each)."""
    arm64_root()  # skips when no root was asked for (remembers its own failure)
    if "error" in _done:
        pytest.fail(f"the emulated runs failed (see the first error): {_done['error']}")
    if "runs" not in _done:
        try:
            _done["runs"] = _all_runs()
        except Exception as e:
            _done["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            raise
    return _done["runs"]


def _all_runs() -> dict:
    t0 = time.monotonic()
    seed = run_in_root("v2", "/opt/venv/bin/python", "-c", SEED)
    assert seed.returncode == 0 and "'576x49152': 'native'" in seed.stdout.replace('"', "'"), seed.stdout[-3000:]
    t1 = time.monotonic()
    with ThreadPoolExecutor(len(PROFILES)) as pool:
        futures = {p: pool.submit(_profile_runs, p) for p in PROFILES}
        results = {p: f.result() for p, f in futures.items()}
    lines = [f"seed (model conversion + lm_head choice) {t1 - t0:.0f} s"]
    for p, res in results.items():
        lines.append(f"{p}: " + ", ".join(f"{k} {v.seconds if hasattr(v, 'seconds') else v['seconds']:.0f} s"
                                          for k, v in res.items()))
    print("\nemulated runs: " + "; ".join(lines) + f"; total {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return results


def _doctor(runs, profile) -> dict:
    r = runs[profile]["doctor"]
    assert r.returncode in (0, 1), r.stdout[-3000:]
    return json.loads(r.stdout[r.stdout.index("{"):])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("profile", PROFILES)
def test_generate_answers_paris(runs, profile, mode):
    r = runs[profile][mode]
    if profile == "n1" and mode == "bfloat16":
        pytest.skip("N1 has no BF16: test_n1_refuses_bfloat16_gemm checks the refusal instead")
    assert r.returncode == 0, r.stdout[-4000:]
    assert "Paris" in r.stdout, r.stdout[-4000:]
    banner = " ".join(r.stdout.split())
    backend = MODES[mode][MODES[mode].index("--linear-backend") + 1]
    assert f"qkv_proj {backend}" in banner and f"down_proj {backend}" in banner, banner[:1500]
    # the float lm_head: as named, or (quantized models) as pre-seeded
    assert f"lm_head {LM_HEAD[mode]}" in banner, banner[:1500]


def test_n1_refuses_bfloat16_gemm(runs):
    r = runs["n1"]["bfloat16"]
    msg = " ".join(r.stdout.split())
    assert r.returncode != 0, msg[-3000:]
    assert "linear_backend=onednn" in msg and "BF16" in msg and "Available here: " in msg, msg[-3000:]
    assert "Traceback" not in r.stdout, r.stdout[-4000:]


@pytest.mark.parametrize("profile", PROFILES)
def test_doctor_reports_the_arm_runtime(runs, profile):
    d = _doctor(runs, profile)
    assert d["cpu"]["arch"] == "aarch64"
    assert {k: d["cpu"]["features"][k] for k in FEATURES[profile]} == FEATURES[profile]
    assert d["cpu"]["sve_vector_bits"] == (128 if profile == "v2" else None)
    assert d["cpu"]["native_bf16"] is (profile == "v2")
    # the native kernels: cross-built for aarch64 and picked by the dispatcher from the CPU's hwcaps
    k = d["kernels"]
    assert k["available"] is True, k
    assert k["variants"] == VARIANTS[profile] and k["variant"] == VARIANTS[profile][0], k
    t = d["torch"]
    assert t["version"].startswith("2.10.0") and t["cuda"] is None, t
    assert t["kleidiai"] is True and t["acl"] is True, t
    assert t["mkldnn_bf16"] is (profile == "v2"), t
    # oneDNN's float GEMM runs through the Arm Compute Library, not a reference kernel
    assert "acl" in d["onednn"]["implementation"] and "ref" not in d["onednn"]["implementation"], d["onednn"]
    assert d["onednn"]["isa"].startswith("AArch64") and ("SVE" in d["onednn"]["isa"]) is (profile == "v2"), d["onednn"]
    # `appliance serve` preloads mimalloc 3.4 (cmeel-mimalloc's aarch64 wheel)
    a = d["allocator"]
    assert a["serve_default"] == "mimalloc" and a["mimalloc_version"].startswith("3.4"), a
    # torch 2.10.0's aarch64 wheel bundles GCC 13's libgomp, built with outline atomics
    g = d["libgomp"]
    assert g["classification"]["verdict"] == "outline-atomics", g
    assert g["classification"]["lse"] > 0, g
    assert not [p for p in d["problems"] if p["severity"] == "error"], d["problems"]


@pytest.mark.parametrize("profile", PROFILES)
def test_serve_answers_a_chat_request(runs, profile):
    s = runs[profile]["serve"]
    assert s["status"] == 200, f"{s['status']}: {s['body']}\n{s['log'][-4000:]}"
    choice = s["body"]["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"].strip(), s["body"]
    assert s["body"]["usage"]["completion_tokens"] >= 1, s["body"]
    # the engine process runs on the mimalloc `serve` preloads, checked from inside it
    info = [line for line in s["metrics"].splitlines() if line.startswith("appliance:allocator_info{")]
    assert info and 'allocator="mimalloc"' in info[0] and 'mimalloc_live="true"' in info[0], s["metrics"][-3000:]
    assert s["rc"] == 0, f"the server did not exit 0 on SIGTERM (rc {s['rc']}):\n{s['log'][-4000:]}"
