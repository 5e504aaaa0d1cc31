"""llama.cpp's own tools (llama-bench, llama-server, llama-quantize), built from the llama.cpp sources
vendored inside the llama-cpp-python sdist, for benchmarks that compare against llama.cpp itself
rather than through its Python binding.

The version is the one ``make peers`` pins (``servers.LLAMA_CPP_PYTHON_VERSION`` below mirrors it):
``pip download --no-binary :all: --no-deps llama-cpp-python==VERSION`` into
``~/.cache/appliance/llamacpp/sdist/``, the tarball's ``vendor/llama.cpp`` unpacked into
``~/.cache/appliance/llamacpp/VERSION/src``, configured with cmake (Release, GGML_NATIVE=ON,
LLAMA_CURL=OFF, no tests/examples) into ``.../VERSION/build`` and only the three targets built.
A finished build (all three binaries present and a ``BUILD_OK`` stamp) is reused.

    python -m appliance.bench.llamacpp            # build (or reuse); prints the bin directory
    python -m appliance.bench.llamacpp --jobs 2

The build takes ~8-10 min on 2 Zen 3 cores; do it ahead of any timed run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

# Kept equal to the Makefile's `peers` pin (llama-cpp-python[server]==0.3.36).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TARGETS = ("llama-bench", "llama-server", "llama-quantize")


def cache_root() -> Path:
    base = os.environ.get("APPLIANCE_LLAMACPP_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "appliance" / "llamacpp"


def build_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_root() / version


def bin_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return build_dir(version) / "build" / "bin"


def tool(name: str, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return bin_dir(version) / name


def is_built(version: str = LLAMA_CPP_PYTHON_VERSION) -> bool:
    d = build_dir(version)
    return (d / "BUILD_OK").exists() and all((bin_dir(version) / t).exists() for t in TARGETS)


def _log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def sdist(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The llama-cpp-python sdist tarball, downloaded with pip on first use."""
    d = cache_root() / "sdist"
    d.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{version}.tar.gz"
    if not (d / name).exists():
        _log(f"pip download llama-cpp-python=={version} (sdist) into {d}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={version}", "-d", str(d)], check=True)
    if not (d / name).exists():
        raise FileNotFoundError(f"pip download gave no {name} in {d}")
    return d / name


def source(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """vendor/llama.cpp from the sdist, unpacked once into BUILD_DIR/src."""
    src = build_dir(version) / "src"
    if (src / "CMakeLists.txt").exists():
        return src
    tgz = sdist(version)
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    tmp = build_dir(version) / "src.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _log(f"unpacking {prefix} from {tgz.name}")
    with tarfile.open(tgz) as tf:
        members = []
        for m in tf.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix):]
                members.append(m)
        if not members:
            raise RuntimeError(f"{tgz} has no {prefix}")
        tf.extractall(tmp, members=members, filter="data")
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)
    return src


def cmake_args(src: Path, build: Path) -> list[str]:
    return ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"]


def build(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None, force: bool = False) -> Path:
    """Build (or reuse) llama-bench, llama-server and llama-quantize; returns their directory."""
    if is_built(version) and not force:
        return bin_dir(version)
    if shutil.which("cmake") is None or (shutil.which("c++") is None and shutil.which("g++") is None):
        raise RuntimeError("building llama.cpp needs cmake and a C++ compiler "
                           "(apt-get install -y cmake build-essential)")
    src = source(version)
    b = build_dir(version) / "build"
    (build_dir(version) / "BUILD_OK").unlink(missing_ok=True)
    _log("cmake configure: " + " ".join(cmake_args(src, b)[5:]))
    subprocess.run(cmake_args(src, b), check=True)
    jobs = jobs or os.cpu_count() or 2
    _log(f"building {', '.join(TARGETS)} with -j{jobs} (minutes)")
    subprocess.run(["cmake", "--build", str(b), "--config", "Release", "-j", str(jobs), "--target", *TARGETS],
                   check=True)
    missing = [t for t in TARGETS if not (bin_dir(version) / t).exists()]
    if missing:
        raise RuntimeError(f"llama.cpp build finished without {missing} in {bin_dir(version)}")
    info = subprocess.run([str(tool("llama-bench", version)), "--version"], capture_output=True, text=True)
    (build_dir(version) / "BUILD_OK").write_text((info.stdout + info.stderr).strip() + "\n")
    return bin_dir(version)


def version_info(version: str = LLAMA_CPP_PYTHON_VERSION) -> str:
    """`llama-bench --version` as recorded after the build (llama.cpp commit and compiler)."""
    f = build_dir(version) / "BUILD_OK"
    return f.read_text().strip() if f.exists() else ""


def quantize(src: str | os.PathLike, dst: str | os.PathLike, qtype: str = "Q4_K_M", threads: int = 2,
             version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """``llama-quantize SRC DST QTYPE THREADS`` into a temporary name, renamed into place."""
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp")
    r = subprocess.run([str(tool("llama-quantize", version)), str(src), str(tmp), qtype, str(threads)],
                       capture_output=True, text=True)
    if r.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {src} -> {qtype} failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    os.replace(tmp, dst)
    (dst.parent / f"{dst.name}.quantize.log").write_text(r.stdout + r.stderr)
    return dst


def llama_bench(model: str | os.PathLike, threads: int, prompt_len: int, gen_len: int, reps: int,
                depths: tuple[int, ...] = (0,), version: str = LLAMA_CPP_PYTHON_VERSION) -> tuple[list[dict], str]:
    """``llama-bench -m MODEL -t T -p P -n N -r R -d D,... -o json``: its JSON rows and the command.

    Rows with ``n_prompt=P, n_gen=0`` are prompt processing (``avg_ts`` tokens/s over ``samples_ts``),
    ``n_prompt=0, n_gen=N`` decode of N tokens after ``n_depth`` tokens already in the KV cache."""
    import json

    cmd = [str(tool("llama-bench", version)), "-m", str(model), "-t", str(threads), "-p", str(prompt_len),
           "-n", str(gen_len), "-r", str(reps), "-o", "json"]
    if tuple(depths) != (0,):
        cmd += ["-d", ",".join(str(d) for d in depths)]
    from appliance.bench.servers import server_env, shell_cpus

    with shell_cpus():  # the CPUs and environment of a shell, not the bench process's pinned thread
        r = subprocess.run(cmd, capture_output=True, text=True, env=server_env())
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout), " ".join(cmd)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_json(url: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}


def llama_server_run(model: str | os.PathLike, threads: int, prompts: list[list[int]], gen_len: int,
                     parallel: int = 4, ctx: int = 4096, timeout: float = 600,
                     version: str = LLAMA_CPP_PYTHON_VERSION, extra_args: list[str] | None = None,
                     ignore_eos: bool = True) -> dict:
    """Start ``llama-server -m MODEL -t T -np PARALLEL -c CTX``, time it until ``/health`` answers 200
    (process start to ready: the load time), read its RSS (psutil), then send each prompt (token
    ids) alone to ``/completion`` (greedy, ``n_predict=gen_len``, no prompt cache; ``ignore_eos``:
    exactly gen_len tokens, else it ends at its end of turn) and keep the server's own ``timings``
    (prompt_per_second, predicted_per_second)."""
    import time

    import psutil

    port = _free_port()
    cmd = [str(tool("llama-server", version)), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-np", str(parallel), "-c", str(ctx), "--no-webui", *(extra_args or [])]
    log = build_dir(version) / "llama-server.log"
    with open(log, "w") as logf:
        t0 = time.perf_counter()
        from appliance.bench.servers import server_env, shell_cpus

        # as from a shell: under `appliance bench` this thread is bound to one CPU (libgomp's place 0)
        # and the environment holds the bench's OpenMP placement; llama-server inherited both
        with shell_cpus():
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=server_env())
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited ({proc.returncode}); see {log}")
                if time.perf_counter() - t0 > timeout:
                    raise RuntimeError(f"llama-server not ready after {timeout}s; see {log}")
                try:
                    code, _ = _http_json(f"http://127.0.0.1:{port}/health", timeout=5)
                except OSError:
                    code = 0
                if code == 200:
                    break
                time.sleep(0.05)
            load_s = time.perf_counter() - t0
            rss_load = psutil.Process(proc.pid).memory_info().rss
            runs = []
            for ids in prompts:
                t = time.perf_counter()
                code, out = _http_json(f"http://127.0.0.1:{port}/completion",
                                       {"prompt": ids, "n_predict": gen_len, "ignore_eos": ignore_eos, "temperature": 0,
                                        "cache_prompt": False}, timeout=timeout)
                if code != 200:
                    raise RuntimeError(f"llama-server /completion answered {code}; see {log}")
                tm = out.get("timings", {})
                runs.append({"wall_s": time.perf_counter() - t, "prompt_n": tm.get("prompt_n"),
                             "prompt_per_second": tm.get("prompt_per_second"), "predicted_n": tm.get("predicted_n"),
                             "predicted_per_second": tm.get("predicted_per_second"),
                             "tokens_predicted": out.get("tokens_predicted"),
                             # with a draft model (-md): drafts proposed and accepted
                             "draft_n": tm.get("draft_n"), "draft_n_accepted": tm.get("draft_n_accepted")})
            rss_run = psutil.Process(proc.pid).memory_info().rss
        finally:
            import signal

            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
    return {"command": " ".join(cmd), "load_s": load_s, "rss_after_load": rss_load, "rss_after_runs": rss_run,
            "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python sdist version")
    ap.add_argument("--jobs", "-j", type=int, default=None, help="build parallelism (default: all CPUs)")
    ap.add_argument("--force", action="store_true", help="rebuild even when a finished build exists")
    a = ap.parse_args(argv)
    print(build(a.version, a.jobs, a.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
