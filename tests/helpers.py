"""Helpers shared by test modules."""
from __future__ import annotations

import torch

from appliance import SamplingParams
from appliance.engine.request import Request
from appliance.engine.scheduler import SchedulerOutput


def engine_logits(llm, ids: list[int]) -> torch.Tensor:
    """Last-token float32 logits of one prompt through the engine's model runner (whole-prompt
    prefill through the paged KV cache), without sampling. ``llm``: an ``LLM`` or an ``LLMEngine``."""
    eng = getattr(llm, "engine", llm)
    req = Request("logits-probe", ids, SamplingParams(max_tokens=1), (), 1)
    assert eng.kv.allocate_slots(req, len(ids))
    try:
        logits, _ = eng.runner.execute(SchedulerOutput([(req, len(ids))], len(ids)))
    finally:
        eng.kv.free(req)
    return logits[0]


def refusal_reason(backend: str, dtype: torch.dtype = torch.float32) -> str | None:
    """None where this host runs linear backend ``backend`` for ``dtype`` layers. Elsewhere (a CPU
    without the feature it needs, or an ISA cap) the reason, after asserting that the engine refuses
    the backend by name with that reason and names the backends it has instead."""
    import pytest
    from torch import nn

    from appliance.layers import quant
    from appliance.layers.linear import Linear, host_problem, select_backends

    why = host_problem(backend, dtype, torch.device("cpu"))
    if why is None:
        return None
    lin = Linear(64, 32)
    lin.weight.data = torch.randn(32, 64).to(dtype)
    layer = lin
    for scheme, names in quant.BACKENDS.items():
        if backend in names:
            layer = quant.QuantLinear.from_float(lin, scheme, 32)
    with pytest.raises(ValueError) as e:
        select_backends(nn.Sequential(layer), backend, dtype, torch.device("cpu"))
    msg = str(e.value)
    assert f"linear_backend={backend} " in msg and why in msg and "Available here: " in msg, msg
    return why


def skip_unless_backend(backend: str, dtype: torch.dtype = torch.float32) -> None:
    """Run the calling test only where ``backend`` runs; elsewhere assert its refusal and skip, saying why."""
    import pytest

    why = refusal_reason(backend, dtype)
    if why is not None:
        pytest.skip(f"{backend} ({dtype}) is refused on this host, refusal asserted: {why}")


def first_usable_backend(*names: str, dtype: torch.dtype = torch.float32) -> str:
    """The first of ``names`` this host runs (for tests about something else than the backend)."""
    from appliance.layers.linear import host_problem

    return next(n for n in names if host_problem(n, dtype, torch.device("cpu")) is None)


def assert_matches_reference(backend: str, qw: torch.Tensor, s: torch.Tensor, zp: torch.Tensor | None,
                             xs=None) -> None:
    """Quantized backend ``backend`` (packed from the canonical ``qw, s, zp``) against its fp64
    reference at 1, 7 and 33 tokens (or the given activations ``xs``), within the tolerance every
    quantized backend is held to; the A8 ones must also differ visibly from float activations."""
    from appliance.layers import quant

    n, k = qw.shape
    bias = torch.randn(n) * 0.1
    p = quant.pack(backend, qw, s, zp)
    for x in xs or [torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in (1, 7, 33)]:
        m = x.shape[0]
        got = quant.run(backend, p, x, n, k) + bias
        want = quant.reference(backend, x, qw, s, bias, zp)
        # fp32 accumulation over k terms: the error grows ~sqrt(k) * eps * |terms|; given inputs
        # (the worst cases) may cancel to ~0, so their bound scales with the sum of |terms|
        size = want.abs().max().item() if xs is None else \
            (x.abs().double() @ quant.dequantize(qw, s, zp).abs().t()).max().item() / 10
        tol = 2e-5 * size * (k / 576) ** 0.5 + 1e-6
        if backend in ("w4a16_int4pack", "w8a16_int8pack"):  # bf16 output (their fast route): 2^-9 relative
            diff = (got.double() - bias.double() - (want - bias.double())).abs()
            bound = (want - bias.double()).abs() * 2 ** -8 + tol
            assert (diff <= bound).all(), f"{backend} m={m}: max excess {(diff - bound).max():.3g}"
            continue
        err = (got.double() - want).abs().max().item()
        assert err <= tol, f"{backend} m={m}: max error {err:.3g} > {tol:.3g}"
        if backend.endswith("a8"):  # activations are quantized: a float reference differs visibly
            assert (got.double() - (x.double() @ quant.dequantize(qw, s, zp).t() + bias)).abs().max() > tol


def hf_greedy(path, prompts_ids, max_new):
    """transformers' model at ``path`` (float32) and its greedy continuation of each prompt."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    outs = []
    for ids in prompts_ids:
        g = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(g[0, len(ids):].tolist())
    return hf, outs


def check_against_transformers(llm, path, ids, max_new):
    """The engine's greedy tokens equal transformers' and its last-token logits are within 1e-4
    (float32), the pool is intact and every block is back. Returns transformers' tokens."""
    outs = llm.generate(prompt_token_ids=ids,
                        sampling_params=SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True))
    hf, ref = hf_greedy(path, ids, max_new)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for p in ids:
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(engine_logits(llm, p), want, atol=1e-4, rtol=0)
    llm.engine.check_integrity()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.num_blocks
    return ref


def drive_engine(engine, ids, params, stagger: int = 0, order=None, after_step=None, whole_outputs: bool = False):
    """Drive an ``LLMEngine`` step by step: every prompt of ``ids`` (in ``order``), all at once
    (``stagger`` 0) or one every ``stagger`` steps, with the block pool's integrity checked after
    every step (and ``after_step(engine)`` when given). Every block must be back in the pool at the
    end. Returns each request's token ids (its whole first output with ``whole_outputs``), by index."""
    pending, done, step = list(order or range(len(ids))), {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and (stagger == 0 or step % stagger == 0):
            batch = pending if stagger == 0 else pending[:1]
            for i in batch:
                engine.add_request(str(i), ids[i], params)
            pending = pending[len(batch):]
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0] if whole_outputs else out.outputs[0].token_ids
        engine.check_integrity()
        if after_step is not None:
            after_step(engine)
        step += 1
        assert step < 5000
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks  # everything returned
    return [done[i] for i in range(len(ids))]


def capture_logits(engine) -> dict:
    """Wraps the runner: {(request id, position): [(input tokens up to it, logits row), ...]}, every
    logits row a step computes (a prompt's last token, a decode's, each speculative draft's)."""
    rows: dict = {}
    execute = engine.runner.execute

    def hooked(sched, *a, **kw):
        plan = []
        for req, n in sched.scheduled:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            tokens = list(req.all_token_ids[:end]) + list(req.spec_token_ids[:max(0, end - req.num_tokens)])
            num_spec = end - req.num_tokens
            if num_spec > 0:
                plan += [(req.request_id, p, tuple(tokens[:p + 1])) for p in range(end - 1 - num_spec, end)]
            elif end == req.num_tokens:
                plan.append((req.request_id, end - 1, tuple(tokens)))
        logits, extra = execute(sched, *a, **kw)
        if logits is not None:
            assert logits.shape[0] == len(plan)
            for (rid, p, toks), row in zip(plan, logits):
                rows.setdefault((rid, p), []).append((toks, row.clone()))
        return logits, extra

    engine.runner.execute = hooked
    return rows


def run_capturing_logits(model, ids, params, cfg: dict, stagger: int = 0):
    """An engine of ``cfg`` on ``model`` through ``drive_engine``: (outputs, {(request id, position):
    [logits rows]}) with only the rows computed on the final tokens (a rejected draft's later rows saw
    other tokens)."""
    from appliance.config import EngineConfig
    from appliance.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model), **cfg))
    rows = capture_logits(engine)
    outs = drive_engine(engine, ids, params, stagger)
    final = {str(i): tuple(ids[i]) + tuple(outs[i]) for i in range(len(ids))}
    return outs, {k: [r for toks, r in v if toks == final[k[0]][:len(toks)]] for k, v in rows.items()}


def logits_one_at_a_time(model, ids, params, cfg: dict):
    """Each prompt alone through an engine of ``cfg``: (outputs, {(request index as str, position):
    [logits rows]}), the reference of the schedule tests."""
    outs, rows = [], {}
    for i, p in enumerate(ids):
        o, r = run_capturing_logits(model, [p], params, cfg)
        outs.append(o[0])
        rows.update({(str(i), pos): v for (_, pos), v in r.items()})
    return outs, rows


def assert_logits_rows_equal(rows: dict, ref_rows: dict, outs, what) -> None:
    """Every captured logits row bit for bit the reference's at its position, and every output position
    compared at least once (rows at each prompt's last token included)."""
    compared = 0
    for key, found in rows.items():
        for row in found:
            assert key in ref_rows, key
            assert torch.equal(row, ref_rows[key][0]), (*what, key,
                                                        (row.float() - ref_rows[key][0].float()).abs().max().item())
            compared += 1
    assert compared >= sum(len(o) for o in outs)


def kquant_reference(x: torch.Tensor, qweight: torch.Tensor, t: dict) -> torch.Tensor:
    """fp64 reference of the kernel's math on the file's weights: the activations quantized per token
    (``quant_act_asym``) meet ``d sc q``; the offset ``d sc shift - dmin mn`` meets the float
    activations' group sums. This is ``method.reference`` of the canonical form, groups of scale 0
    included (sc = 0: every weight ``-dmin mn``; the canonical form holds q = 0 there and all of the
    weight in its zero point, as the K-quant form holds all of it in ``dmin mn``)."""
    from appliance.layers.methods.qmath import group_sums, quant_act_asym

    g, sb = t["group"], t["super"]
    scale = t["sup"].double().repeat_interleave(sb // g, dim=1) * t["sub"].double()
    off = t["shift"].double()[:, None] * scale
    if t["submin"] is not None:
        off -= t["supmin"].double().repeat_interleave(sb // g, dim=1) * t["submin"].double()
    w_sym = qweight.double() * scale.repeat_interleave(g, dim=1)
    return quant_act_asym(x.float()).double() @ w_sym.t() + group_sums(x.float().double(), scale.shape[1]) @ off.t()


def stack_at_every_step_size(monkeypatch) -> None:
    """Keep ``native`` float32 layers in the one-call decoder stack at every step size, in this process and
    in tensor-parallel ranks started after this call: the stack's own tests hold it to the per-op path on
    prefill-sized steps too (the engine leaves steps above ``NATIVE_F32_MAX_ROWS`` to the per-op path when
    the stack holds a native layer; tests/model/test_native_prefill_rows.py covers that split)."""
    from appliance.layers.methods import floating

    big = 1 << 30
    monkeypatch.setattr(floating, "NATIVE_F32_MAX_ROWS", big)
    monkeypatch.setenv(floating.NATIVE_F32_MAX_ROWS_ENV, str(big))
