"""End to end on the default model (SmolLM2-135M-Instruct): quantized at load, W8A8 and W4A8 stay
close to float on a held-out English text written for these tests (tests/quant/data/heldout_en.txt,
never seen by the model's authors) and agree with float's greedy continuations.

The activation-quantizing backends are forced (w8a8_onednn and w8a8_native, w4a8_dynquant: the math
KleidiAI runs on Arm), so the bounds hold for the int8-activation numerics whatever `auto` would pick on this host.
On x86, torch's `_dyn_quant_matmul_4bit` is a slow scalar fallback (minutes for this text), so there
the W4A8 layers run the same math as an fp32 emulation (dequantized weights, the same per-token
asymmetric int8 activations); test_kernels.py holds the real kernel to that math per shape."""
from __future__ import annotations

import math
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import skip_unless_backend

from appliance import LLM, SamplingParams
from appliance.layers.linear import host_problem
from appliance.layers import quant

TEXT = (Path(__file__).parent / "data" / "heldout_en.txt").read_text()
WINDOW = 512  # tokens per scored window (non-overlapping): bounded prefill, context of up to 511
KW = {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory": 0.25, "enable_prefix_caching": False}
PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village,", "To make a cup of tea, first",
    "The main causes of the French Revolution were", "def fibonacci(n):\n    ", "Photosynthesis is the process by which",
    "The best way to learn a new language is", "In 1969, astronauts", "My favourite season is autumn because",
    "The three primary colours are", "Water boils at", "A good night's sleep helps",
    "The largest planet in the solar system", "Shakespeare wrote", "To stay healthy, people should",
    "The internet was invented", "Dogs make good pets because", "The recipe calls for two cups of",
    "In the middle of the night, the old house", "Machine learning is a field of",
]
CONFIGS = {"float": {}, "w8a8": {"quantization": "w8a8", "linear_backend": "w8a8_onednn"},
           "w8a8_native": {"quantization": "w8a8", "linear_backend": "w8a8_native"},
           "w4a8": {"quantization": "w4a8", "linear_backend": "w4a8_dynquant"},
           # the weight-only routes `auto` may pick on x86 (bf16 activations)
           "w8a16": {"quantization": "w8a8", "linear_backend": "w8a16_int8pack"},
           "w4a16": {"quantization": "w4a8", "linear_backend": "w4a16_int4pack"}}
BOUNDS = {"w8a8": (1.03, 0.90), "w8a8_native": (1.03, 0.90), "w4a8": (1.12, 0.75), "w8a16": (1.03, 0.90), "w4a16": (1.12, 0.75)}  # (perplexity ratio at most, agreement at least)


def _logprob(v) -> float:
    return v.logprob if hasattr(v, "logprob") else v


def _perplexity(llm) -> float:
    ids = llm.get_tokenizer().encode(TEXT)
    assert len(ids) > 2000
    windows = [ids[i:i + WINDOW] for i in range(0, len(ids) - 1, WINDOW)]
    outs = llm.generate([w for w in windows if len(w) > 1], SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll, n = 0.0, 0
    for w, o in zip(windows, outs):
        for tok, lp in zip(w[1:], o.prompt_logprobs[1:]):
            nll -= _logprob(lp[tok])
            n += 1
    return math.exp(nll / n)


def _greedy(llm) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def _top1_on_path(llm, paths: list[list[int]]) -> float:
    """Fraction of the 32 positions of each float greedy continuation at which this model's own
    greedy choice, given the same prefix, is float's token (teacher-forced greedy agreement)."""
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) + path for p, path in zip(PROMPTS, paths)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    hit = total = 0
    for path, o in zip(paths, outs):
        for t, lp in zip(path, o.prompt_logprobs[len(o.prompt_logprobs) - len(path):]):
            hit += max(lp, key=lambda k: _logprob(lp[k])) == t
            total += 1
    return hit / total


def _emulate_dynquant(mp):
    real_pack, real_run = quant.pack, quant.run

    def pack(backend, qweight, scale, zero_point=None):
        if backend != "w4a8_dynquant":
            return real_pack(backend, qweight, scale, zero_point)
        off = quant._offset(scale, zero_point)
        held = scale if scale.shape[1] == 1 else scale.bfloat16()  # KleidiAI holds group scales in bf16
        return {"wd": quant.dequantize(qweight, held, None, torch.float32), "group": qweight.shape[1] // scale.shape[1],
                "offset_t": None if off is None else off.t().contiguous()}

    def run(backend, p, x, n, k):
        if backend != "w4a8_dynquant":
            return real_run(backend, p, x, n, k)
        xf = x.float()
        y = F.linear(quant._quant_act_asym(xf), p["wd"])
        if p["offset_t"] is not None:
            y = torch.addmm(y, xf.reshape(xf.shape[0], -1, p["group"]).sum(-1), p["offset_t"])
        return y

    mp.setattr(quant, "pack", pack)
    mp.setattr(quant, "run", run)
    # the one-call decoder stack would run the real kernel on the stand-in's packed weights: op by op
    # (bitwise the same results for every other backend: tests/model/test_parity.py)
    from appliance.ops import native

    mp.setattr(native, "FUSED_LAYERS", False)


@pytest.fixture(scope="module")
def results():
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        if platform.machine().lower() not in ("aarch64", "arm64"):
            _emulate_dynquant(mp)
        for name, kw in CONFIGS.items():
            if "linear_backend" in kw and host_problem(kw["linear_backend"], torch.float32, torch.device("cpu")):
                continue  # refused on this host: its test asserts the refusal
            llm = LLM(**KW, **kw)
            greedy = _greedy(llm)
            out[name] = (_perplexity(llm), greedy, _top1_on_path(llm, out["float"][1] if out else greedy))
            del llm
    return out


def _prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of the 32-token free-running continuations' positions before their first divergence."""
    same = 0
    for x, y in zip(a, b):
        k = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
        same += k
    return same / sum(len(x) for x in a)


@pytest.mark.parametrize("scheme", ["w8a8", "w8a8_native", "w4a8", "w8a16", "w4a16"])
def test_quantized_close_to_float(results, scheme):
    skip_unless_backend(CONFIGS[scheme]["linear_backend"])
    ppl_f, greedy_f, _ = results["float"]
    ppl_q, greedy_q, agree = results[scheme]
    ratio = ppl_q / ppl_f
    # Free-running continuations of a 135M model part at the first near-tie and never meet again
    # (even weight-only int8 keeps only ~57% of positions before the first divergence), so the
    # bound is on the teacher-forced agreement; the free-running figure is printed for the record.
    print(f"{scheme}: perplexity {ppl_q:.3f} vs float {ppl_f:.3f} (x{ratio:.4f}); greedy agreement on "
          f"float's path {agree:.3f}; free-running before first divergence {_prefix_agreement(greedy_q, greedy_f):.3f}")
    max_ratio, min_agree = BOUNDS[scheme]
    assert ratio <= max_ratio, f"{scheme} perplexity {ppl_q:.3f} is x{ratio:.4f} float's {ppl_f:.3f}"
    assert agree >= min_agree, f"{scheme} agrees with float greedy on {agree:.1%} of the first 32 tokens"
