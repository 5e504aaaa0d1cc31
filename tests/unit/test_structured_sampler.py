"""The sampler's grammar mask and logit_bias against an fp64 torch reference of the whole sampling
pipeline (penalties, logit_bias, mask, temperature, top-k, top-p, min-p), and the checks on
logit_bias and on constraints (errors name the field)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from appliance.engine.request import Request
from appliance.engine.sampler import Sampler, apply_token_bitmask
from appliance.errors import InvalidRequestError
from appliance.sampling_params import SamplingParams, StructuredOutputsParams, check_logit_bias_vocab
from appliance.structured import StepMasks, validate

VOCAB = 77  # not a multiple of 32: the last mask word is partial


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [rows, vocab] -> int32 [rows, ceil(vocab / 32)], bit t % 32 of word t // 32 = token t."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, -(-vocab // 32) * 32), dtype=bool)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32).copy()


def test_apply_token_bitmask_exact():
    rng = np.random.default_rng(0)
    allowed = rng.random((3, VOCAB)) < 0.3
    logits = torch.randn(5, VOCAB)
    want = logits.clone()
    rows = [0, 2, 4]
    for j, r in enumerate(rows):
        want[r, torch.from_numpy(~allowed[j])] = float("-inf")
    got = logits.clone()
    apply_token_bitmask(got, rows, torch.from_numpy(pack(allowed)))
    assert torch.equal(got, want)
    # a model vocabulary wider than the mask: the columns beyond it are masked
    wide = torch.randn(3, VOCAB + 40)
    apply_token_bitmask(wide, [0, 1, 2], torch.from_numpy(pack(allowed)))
    assert torch.isneginf(wide[:, 32 * pack(allowed).shape[1]:]).all()


def reference_probs(logits: torch.Tensor, req: Request, allowed: np.ndarray | None) -> torch.Tensor:
    """fp64, written from the definitions: penalties (repetition on prompt and output, presence and
    frequency on output), + logit_bias, grammar mask, / temperature, top-k, top-p (smallest prefix
    whose mass reaches top_p), min-p (relative to the most likely token)."""
    sp = req.sampling_params
    x = logits.double().clone()
    for t in set(req.all_token_ids):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(req.output_token_ids):
        c = req.output_token_ids.count(t)
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty
    for t, b in (sp.logit_bias or {}).items():
        x[t] += b
    if allowed is not None:
        x[torch.from_numpy(~allowed)] = float("-inf")
    x = x / sp.temperature
    p = torch.softmax(x, dim=0)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if (sp.top_k > 0 and rank >= sp.top_k) or p[t] == 0:
            break
        if rank > 0 and mass >= sp.top_p:
            break
        keep[t] = True
        mass += float(p[t] / p[order[: min(len(order), sp.top_k or len(order))]].sum())
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    p = torch.where(p >= sp.min_p * p.max(), p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
         presence_penalty=0.5, frequency_penalty=0.4, logit_bias={3: 2.0, 10: -1.0}),
    dict(temperature=1.3, top_p=0.5, logit_bias={5: 100.0}),
])
def test_masked_sampling_matches_reference(kw):
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    logits = torch.randn(VOCAB) * 3
    allowed = rng.random(VOCAB) < 0.4
    allowed[[3, 5, 10]] = True
    sp = SamplingParams(max_tokens=64, **kw)
    prompt = rng.integers(0, VOCAB, 6).tolist()
    out = rng.integers(0, VOCAB, 5).tolist()
    draws = 6000
    reqs = []
    for i in range(draws):
        r = Request(f"r{i}", prompt, sp, (), 64)
        r.all_token_ids.extend(out)
        reqs.append(r)
    want = reference_probs(logits, reqs[0], allowed)
    free_row = torch.randn(VOCAB)  # a free row in the same batch: never masked
    free = Request("free", prompt, SamplingParams(temperature=0, max_tokens=4), (), 4)
    batch = torch.cat([logits.expand(draws, VOCAB), free_row[None]]).contiguous()
    masks = StepMasks(list(range(draws)), pack(np.repeat(allowed[None], draws, axis=0)))
    got = [r.token_id for r in Sampler(torch.device("cpu"), seed=0)(batch, reqs + [free], masks)]
    assert got[-1] == int(free_row.argmax())
    tokens = np.array(got[:-1])
    assert allowed[tokens].all(), "a masked token was sampled"
    assert set(tokens.tolist()) <= set(torch.nonzero(want).flatten().tolist()), "a token outside the reference support"
    freq = np.bincount(tokens, minlength=VOCAB) / draws
    tv = 0.5 * np.abs(freq - want.numpy()).sum()
    assert tv < 0.04, f"total variation {tv:.3f} between sampled frequencies and the reference"


def test_greedy_masked_row_takes_best_allowed_token():
    logits = torch.arange(VOCAB, dtype=torch.float32)[None].repeat(2, 1)
    allowed = np.zeros((1, VOCAB), dtype=bool)
    allowed[0, [4, 9]] = True
    reqs = [Request(f"g{i}", [1], SamplingParams(temperature=0, max_tokens=4), (), 4) for i in range(2)]
    got = Sampler(torch.device("cpu"))(logits, reqs, StepMasks([1], pack(allowed)))
    assert [r.token_id for r in got] == [VOCAB - 1, 9]


def test_min_tokens_never_empties_a_masked_row():
    """The grammar leaves only EOS while min_tokens bans it: the grammar wins (no NaN sample)."""
    eos = 7
    allowed = np.zeros((1, VOCAB), dtype=bool)
    allowed[0, eos] = True
    req = Request("m", [1], SamplingParams(temperature=1.0, min_tokens=5, max_tokens=8), (eos,), 8)
    got = Sampler(torch.device("cpu"))(torch.randn(1, VOCAB), [req], StepMasks([0], pack(allowed)))
    assert got[0].token_id == eos


def test_logit_bias_forces_and_bans():
    logits = torch.randn(4, VOCAB)
    best = logits.argmax(dim=-1)
    reqs = [Request("a", [1], SamplingParams(temperature=0, logit_bias={11: 100}), (), 4),
            Request("b", [1], SamplingParams(temperature=0, logit_bias={int(best[1]): -100}), (), 4),
            Request("c", [1], SamplingParams(temperature=1.0, logit_bias={12: 100}), (), 4),
            Request("d", [1], SamplingParams(temperature=0), (), 4)]
    got = [r.token_id for r in Sampler(torch.device("cpu"))(logits.clone(), reqs)]
    second = logits[1].clone()
    second[best[1]] -= 100
    assert got == [11, int(second.argmax()), 12, int(best[3])]


@pytest.mark.parametrize("bias, msg", [
    ({"x": 1}, "logit_bias keys must be non-negative token ids, got 'x'"),
    ({-1: 1}, "logit_bias keys must be non-negative token ids, got -1"),
    ({"5": 100.5}, "logit_bias[5] must be a number in [-100, 100], got 100.5"),
    ({5: "a"}, "logit_bias[5] must be a number in [-100, 100], got 'a'"),
])
def test_logit_bias_refused(bias, msg):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias=bias)
    assert str(e.value) == msg and e.value.param == "logit_bias"


def test_logit_bias_vocab_range():
    assert SamplingParams(logit_bias={"3": -100, 4: 100}).logit_bias == {3: -100.0, 4: 100.0}
    with pytest.raises(InvalidRequestError, match=r"logit_bias token ids must be in \[0, 10\), got \[10, 99\]"):
        check_logit_bias_vocab({10: 1.0, 99: 1.0, 2: 1.0}, 10)


@pytest.mark.parametrize("params, field, fragment", [
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 2}), "structured_outputs.json",
     "minimum (5) is greater than maximum (2)"),
    (StructuredOutputsParams(json={"type": "integr"}), "structured_outputs.json", "integr"),
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex", "unclosed group"),
    (StructuredOutputsParams(grammar="start: foo"), "structured_outputs.grammar", 'unknown name: "foo"'),
    (StructuredOutputsParams(grammar='root ::= "a" | ('), "structured_outputs.grammar", "GBNF"),
])
def test_invalid_constraints_name_the_field(params, field, fragment):
    with pytest.raises(InvalidRequestError) as e:
        validate(params)
    assert e.value.param == field and str(e.value).startswith(field + ": ") and fragment in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        validate(params, "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema"


def test_valid_constraints_compile():
    for p in [StructuredOutputsParams(json={"type": "object"}), StructuredOutputsParams(json_object=True),
              StructuredOutputsParams(regex=r"\d+"), StructuredOutputsParams(choice=["a", 'b"c']),
              StructuredOutputsParams(grammar='start: "x" NUM\nNUM: /[0-9]+/'),
              StructuredOutputsParams(grammar='root ::= "yes" | "no"')]:
        assert validate(p)
