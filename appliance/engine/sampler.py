"""Batched sampling: penalties, min_tokens, logit_bias, the structured-output token mask, greedy, temperature / top-k / top-p / min-p, per-request
seeds, and logprobs of the raw model distribution (as vLLM reports them).

The grammar's mask (``appliance.structured``) is applied after the penalties and logit_bias and
before temperature / top-k / top-p / min-p, so a masked token has probability 0 on every path
(greedy included) and the truncations only ever choose among allowed tokens. Logprobs stay those
of the raw model distribution (as vLLM's default).

A seeded request draws its noise from its own ``torch.Generator``, advanced once per step of that
request, so its output does not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.engine.request import Request


@dataclass
class SampleResult:
    token_id: int
    # {token_id: logprob} with the sampled token and the top-k alternatives; None unless asked for
    logprobs: dict[int, float] | None
    sampled_logprob: float | None


def top_logprobs(logprobs_row: torch.Tensor, token_id: int, k: int) -> dict[int, float]:
    out = {}
    if k > 0:
        vals, ids = torch.topk(logprobs_row, k)
        out = dict(zip(ids.tolist(), vals.tolist()))
    out[token_id] = float(logprobs_row[token_id])
    return out


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bits: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of ``rows`` whose token is not allowed by ``bits``: int32
    ``[len(rows), ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed.
    Columns past the mask's width (a model vocabulary larger than the tokenizer's) are masked."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).reshape(len(rows), -1).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab]
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, argmax=None):
        """``argmax``: the ops backend's row argmax (greedy rows); torch's by default."""
        self.device = device
        self._argmax = argmax or (lambda x: x.argmax(dim=-1))
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        g = self.request_generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(req.sampling_params.seed)
            self.request_generators[req.request_id] = g
        return g

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        for i, req in enumerate(reqs):
            sp = req.sampling_params
            out_ids = req.output_token_ids
            if sp.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=logits.device)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
            if (sp.presence_penalty or sp.frequency_penalty) and out_ids:
                ids = torch.tensor(out_ids, dtype=torch.long, device=logits.device)
                counts = torch.bincount(ids, minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
                logits[i] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)
            if req.num_output_tokens < sp.min_tokens:
                banned = list(req.eos_token_ids) + list(sp.stop_token_ids)
                if banned:
                    logits[i, torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")

    def __call__(self, logits: torch.Tensor, reqs: list[Request], masks=None) -> list[SampleResult]:
        """logits: float32 [len(reqs), vocab] for the last position of each request. ``masks``: an
        ``appliance.structured.StepMasks`` (rows and their int32 bitmasks) or None."""
        n = len(reqs)
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in reqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.process(logits, reqs, masks)

        token_ids = [0] * n
        greedy = [i for i in range(n) if reqs[i].sampling_params.greedy]
        if greedy:
            g = self._argmax(logits[greedy] if len(greedy) < n else logits).tolist()
            for i, t in zip(greedy, g):
                token_ids[i] = t
        random_rows = [i for i in range(n) if not reqs[i].sampling_params.greedy]
        if random_rows:
            for i, t in zip(random_rows, self._sample(logits[random_rows], [reqs[i] for i in random_rows])):
                token_ids[i] = t

        results = []
        for i, req in enumerate(reqs):
            k = req.sampling_params.logprobs
            if k is None:
                results.append(SampleResult(token_ids[i], None, None))
            else:
                d = top_logprobs(raw_logprobs[i], token_ids[i], k)
                results.append(SampleResult(token_ids[i], d, d[token_ids[i]]))
        return results

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row argmax with the backend's op (the greedy choice)."""
        return self._argmax(logits)

    def process(self, logits: torch.Tensor, reqs: list, masks=None) -> torch.Tensor:
        """The logits every choice is made from: raw ``logits`` [len(reqs), vocab] with penalties,
        min_tokens, logit_bias and the grammar mask applied (a copy when anything applies). ``reqs``
        are Requests or anything with the fields the penalties read (speculative decoding passes a
        view of a request with its earlier drafts appended)."""
        n = len(reqs)
        raw_in = logits
        need_penalty = [
            r.sampling_params.repetition_penalty != 1.0 or r.sampling_params.presence_penalty
            or r.sampling_params.frequency_penalty or r.num_output_tokens < r.sampling_params.min_tokens
            for r in reqs
        ]
        if any(need_penalty):
            logits = logits.clone()
            rows = [i for i in range(n) if need_penalty[i]]
            sub = logits[rows]
            self._apply_penalties(sub, [reqs[i] for i in rows])
            logits[rows] = sub
        biased = [i for i in range(n) if reqs[i].sampling_params.logit_bias]
        if biased:
            if logits is raw_in:
                logits = logits.clone()
            for i in biased:
                bias = reqs[i].sampling_params.logit_bias
                ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
                logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        if masks is not None:
            if logits is raw_in:
                logits = logits.clone()
            bits = torch.from_numpy(masks.bits).to(logits.device)
            apply_token_bitmask(logits, masks.rows, bits)
            idx = torch.tensor(masks.rows, dtype=torch.long, device=logits.device)
            dead = torch.isneginf(logits[idx]).all(dim=-1).nonzero().flatten().tolist()
            if dead:
                # min_tokens banned every token the grammar allows (only EOS was left): the grammar
                # wins, and the row samples among its allowed tokens without the ban.
                rows = [masks.rows[j] for j in dead]
                fixed = raw_in[rows].clone()
                apply_token_bitmask(fixed, list(range(len(rows))), bits[dead])
                logits[rows] = fixed
        return logits

    def probs(self, logits: torch.Tensor, reqs: list) -> torch.Tensor:
        """The distribution a sampled (temperature > 0) row draws from: processed ``logits`` with
        temperature, top-k, top-p and min-p applied, [len(reqs), vocab] (min-p leaves it unnormalized)."""
        dev = logits.device
        temps = torch.tensor([r.sampling_params.temperature for r in reqs], dtype=logits.dtype, device=dev)
        logits = logits / temps[:, None]
        top_ks = [r.sampling_params.top_k for r in reqs]
        top_ps = [r.sampling_params.top_p for r in reqs]
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            k = torch.tensor([k if k > 0 else vocab for k in top_ks], device=dev)
            ranks = torch.arange(vocab, device=dev)[None, :]
            drop = ranks >= k[:, None]
            probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
            before = probs.cumsum(dim=-1) - probs
            drop |= before >= torch.tensor(top_ps, dtype=probs.dtype, device=dev)[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = torch.softmax(logits, dim=-1)
        min_ps = [r.sampling_params.min_p for r in reqs]
        if any(m > 0 for m in min_ps):
            m = torch.tensor(min_ps, dtype=probs.dtype, device=dev)[:, None]
            probs = probs.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    def generator_for(self, req) -> torch.Generator:
        """The request's own generator when it is seeded, else the engine's."""
        return self._generator(req) if req.sampling_params.seed is not None else self.generator

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        dev = logits.device
        probs = self.probs(logits, reqs)
        # Gumbel-style sampling: argmax(p / q) with q ~ Exp(1) draws from p.
        q = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(reqs) if r.sampling_params.seed is None]
        if unseeded:
            q[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.sampling_params.seed is not None:
                q[i].exponential_(generator=self._generator(r))
        return (probs / q).argmax(dim=-1).tolist()
