"""Tensor parallel: bad sizes refused at start naming the flag, the value and what is valid; a
worker killed mid-generation makes the engine raise a clear error within seconds; workers end
when rank 0 does."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from appliance import SamplingParams
from appliance.config import EngineConfig
from appliance.distributed.executor import TensorParallelError
from appliance.engine.llm_engine import LLMEngine
from appliance.errors import InvalidRequestError, ModelLoadError


def test_tp_size_must_be_positive_and_fit_the_cpus():
    cpus = len(os.sched_getaffinity(0))
    with pytest.raises(InvalidRequestError, match=f"tensor_parallel_size must be at most the {cpus} CPUs available "
                                                  f".*got {cpus + 1}") as e:
        EngineConfig(tensor_parallel_size=cpus + 1)
    assert e.value.param == "tensor_parallel_size"
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)


def test_tp_with_data_parallel_needs_a_bind_list_per_rank():
    # DP x TP itself is tests/distributed/test_dp_tp.py; here: 2 x 2 ranks need 4 lists
    with pytest.raises(InvalidRequestError, match=r"2 CPU lists \('\|' separates ranks\) for 4 rank\(s\)") as e:
        EngineConfig(tensor_parallel_size=2, data_parallel_size=2, omp_threads_bind="0|1")
    assert e.value.param == "omp_threads_bind"
    # ranks as Ray actors are accepted (tests/distributed/test_tp_ray.py)
    assert EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray").tensor_parallel_size == 2


def test_tp_size_must_divide_the_kv_heads(tiny_model_dir):
    path = tiny_model_dir("llama", num_kv_heads=1)  # 4 query heads, 1 KV head
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=2 does not divide the model's "
                                             r"num_key_value_heads=1; valid sizes for this model: 1$"):
        LLMEngine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=16))


def test_tp_size_must_divide_heads_intermediate_and_vocab():
    from appliance.models.llama import ARCHS, LlamaConfig, check_tp_sizes

    cfg = LlamaConfig.from_hf(dict(vocab_size=384, hidden_size=96, intermediate_size=200, num_hidden_layers=1,
                                   num_attention_heads=6, num_key_value_heads=2), ARCHS["LlamaForCausalLM"])
    check_tp_sizes(cfg, 2)
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=3 does not divide the model's num_key_value_heads=2, "
                                             r"intermediate_size=200; valid sizes for this model: 1, 2$"):
        check_tp_sizes(cfg, 3)
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=4 does not divide the model's num_attention_heads=6"):
        check_tp_sizes(cfg, 4)


def test_architectures_that_do_not_shard_are_refused(tiny_model_dir, monkeypatch):
    # a family module without supports_tensor_parallel (Gemma's, switched off here: every family may shard)
    from appliance.models import gemma

    monkeypatch.setattr(gemma, "supports_tensor_parallel", False)
    path = tiny_model_dir("gemma2")
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=2: architecture Gemma2ForCausalLM does not "
                                             r"shard yet; tensor parallelism supports .*LlamaForCausalLM"):
        LLMEngine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=16))


def test_gemma_size_that_does_not_divide_the_heads_is_refused(tiny_model_dir):
    # (3 ranks exceed this host's CPUs, refused first at config time: the model check is called directly)
    import json

    from appliance.models.llama import check_tp_sizes
    from appliance.models.registry import family_config

    path = tiny_model_dir("gemma3", False, 2, sliding_window=8)  # 4 heads, 2 KV heads
    cfg = family_config("Gemma3ForCausalLM", json.loads((path / "config.json").read_text()))
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=3 does not divide the model's "
                                             r"num_attention_heads=4, num_key_value_heads=2.*valid sizes for this "
                                             r"model: 1, 2"):
        check_tp_sizes(cfg, 3)


def test_a_bind_list_per_rank(llama_dir):
    with pytest.raises(InvalidRequestError, match=r"omp_threads_bind='0\|1\|0': 3 CPU lists \('\|' separates ranks\) "
                                                  r"for 2 rank\(s\)"):
        LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", tensor_parallel_size=2, num_kv_blocks=16,
                               omp_threads_bind="0|1|0"))


def test_a_worker_killed_mid_generation_raises_within_seconds(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), dtype="float32", linear_backend="torch",
                                    tensor_parallel_size=2, num_kv_blocks=64))
    try:
        worker = engine.runner.procs[0]
        for i in range(4):
            engine.add_request(str(i), [5 + i] * 20, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        engine.step()  # running
        killed = []
        timer = threading.Timer(0.3, lambda: (killed.append(time.monotonic()), os.kill(worker.pid, signal.SIGKILL)))
        timer.start()
        with pytest.raises(TensorParallelError) as e:
            for _ in range(100000):  # steps until the kill lands, in a step or between two
                engine.step()
        assert killed and time.monotonic() - killed[0] < 10
        msg = str(e.value)
        assert "tensor_parallel_size=2" in msg and f"rank 1 (pid {worker.pid}) exited with code -9" in msg, msg
        with pytest.raises(TensorParallelError, match="is broken: rank 1"):
            engine.step()  # and it stays failed, at once
    finally:
        engine.runner.close()


def test_workers_exit_when_rank_0_is_killed(llama_dir, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from appliance import LLM
        if __name__ == "__main__":
            llm = LLM({str(llama_dir)!r}, dtype="float32", linear_backend="torch", tensor_parallel_size=2,
                      num_kv_blocks=16)
            print(llm.engine.runner.procs[0].pid, flush=True)
            time.sleep(600)
    """)
    (tmp_path / "rank0.py").write_text(script)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "rank0.py")], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"rank 0 did not start (exit code {proc.poll()})"
        worker = int(line)
        os.kill(worker, 0)  # alive
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            if _zombie(worker):
                break
            time.sleep(0.1)
        else:
            os.kill(worker, signal.SIGKILL)
            pytest.fail("the worker outlived rank 0 by 10 s")
    finally:
        if proc.poll() is None:
            proc.kill()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
