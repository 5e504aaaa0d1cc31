"""`appliance generate` streams the same text the offline engine produces, and rejects bad flags
with an error naming the argument."""
from __future__ import annotations

import subprocess
import sys

from helpers import first_usable_backend

from appliance import LLM, SamplingParams


def run(*args):
    return subprocess.run([sys.executable, "-m", "appliance.cli", "generate", *args],
                          capture_output=True, text=True, timeout=300)


def test_generate_matches_offline_engine(llama_dir):
    prompt = "The quick brown fox"
    want = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    r = run("--model", str(llama_dir), "--prompt", prompt, "--max-tokens", "12", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    assert "12 generated" in r.stderr or "generated" in r.stderr


def test_generate_chat_uses_template(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)
    want = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=8))
    r = run("--model", str(llama_dir), "--chat", "--prompt", "Hello", "--max-tokens", "8", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want[0].outputs[0].text + "\n"


def test_generate_bad_flags(llama_dir, tmp_path):
    r = run("--model", str(llama_dir), "--prompt", "x", "--top-p", "1.5")
    assert r.returncode == 2 and "top_p" in r.stderr and "1.5" in r.stderr
    r = run("--model", str(tmp_path / "missing"), "--prompt", "x")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_convert_cli_round_trip(llama_dir, tmp_path):
    """`appliance convert` writes a checkpoint that loads to the same model as quantizing at load."""
    out = tmp_path / "w8a8"
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "convert", str(llama_dir), str(out),
                        "--quantization", "w8a8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", num_kv_blocks=64, linear_backend=first_usable_backend("w8a8_onednn", "w8a8_native"))
    a = LLM(str(out), **kw).generate(["The quick brown fox"], sp)[0].outputs[0].token_ids
    b = LLM(str(llama_dir), quantization="w8a8", **kw).generate(["The quick brown fox"], sp)[0].outputs[0].token_ids
    assert a == b
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "convert", str(llama_dir), str(tmp_path / "x"),
                        "--quantization", "int3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "int3" in r.stderr
