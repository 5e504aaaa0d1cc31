"""Verification of draft tokens against the target model's distributions.

Greedy: accept drafts while each equals the target's argmax at its position, then append the
target's own choice at the first mismatch (or after the last draft): 1..k+1 tokens, exactly the
tokens greedy decoding without drafts would produce.

Sampling (Leviathan et al., Chen et al.): draft ``d`` drawn from ``q`` is accepted with probability
min(1, p(d) / q(d)); on rejection the token is drawn from normalize(max(p - q, 0)) and the run ends;
when every draft is accepted, one more token is drawn from the next position's ``p``. Each emitted
token is then distributed exactly as ``p`` at its position. An n-gram draft is a point mass
(q(d) = 1): accepted with probability p(d), else drawn from p with d removed.
"""
from __future__ import annotations

import torch


def greedy_accept(target_argmax: list[int], draft: list[int]) -> list[int]:
    """``target_argmax``: the target's choice at each of the ``len(draft) + 1`` positions."""
    out = []
    for j, d in enumerate(draft):
        if d != target_argmax[j]:
            break
        out.append(d)
    out.append(target_argmax[len(out)])
    return out


def rejection_sample(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                     generator: torch.Generator) -> list[int]:
    """``p``: [len(draft) + 1, vocab] target probabilities (rows need not be normalized); ``q``:
    [len(draft), vocab] draft probabilities, or None for point-mass drafts. Returns the emitted
    tokens: the accepted drafts and one token from the residual or the bonus position."""
    p = p.double()
    p = p / p.sum(dim=-1, keepdim=True)
    out: list[int] = []
    for j, d in enumerate(draft):
        if q is None:
            qj = torch.zeros_like(p[j])
            qj[d] = 1.0
        else:
            qj = q[j].double()
            qj = qj / qj.sum()
        u = torch.rand((), dtype=torch.float64, generator=generator, device=p.device)
        if qj[d] > 0 and u * qj[d] < p[j, d]:  # u < p/q: probability min(1, p/q)
            out.append(d)
            continue
        residual = (p[j] - qj).clamp_min(0)
        if not residual.sum() > 0:  # p <= q everywhere means p == q: rejection had probability 0
            residual = p[j]
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(draft)], 1, generator=generator)))
    return out
