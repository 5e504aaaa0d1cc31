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
    """One request: ``p`` [len(draft) + 1, vocab] target probabilities (rows need not be
    normalized), ``q`` [len(draft), vocab] draft probabilities or None for point-mass drafts.
    Returns the emitted tokens: the accepted drafts and one token from the residual or the bonus
    position."""
    d = torch.tensor([draft], dtype=torch.long, device=p.device)
    num_accepted, token = rejection_sample_batch(p[None], d, None if q is None else q[None], generator)
    a = int(num_accepted[0])
    return draft[:a] + [int(token[0])]


def rejection_sample_batch(p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None,
                           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched: ``p`` [B, s + 1, vocab], ``draft`` [B, s] (long), ``q`` [B, s, vocab] or None (point
    masses). Returns (accepted drafts per row [B], the token emitted after them [B])."""
    p = p.double()
    p = p / p.sum(dim=-1, keepdim=True)
    b, s = draft.shape
    if q is None:
        q = torch.nn.functional.one_hot(draft, p.shape[-1]).double()
    else:
        q = q.double()
        q = q / q.sum(dim=-1, keepdim=True)
    idx = draft[..., None]
    pd = p[:, :s].gather(-1, idx)[..., 0]
    qd = q.gather(-1, idx)[..., 0]
    u = torch.rand((b, s), dtype=torch.float64, generator=generator, device=p.device)
    accept = (qd > 0) & (u * qd < pd)  # u < p/q: probability min(1, p/q)
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # up to the first rejection
    rows = torch.arange(b, device=p.device)
    # rejected at position a < s: draw from normalize(max(p - q, 0)); all accepted: from p at s
    j = num_accepted.clamp(max=max(s - 1, 0))
    target = p[rows, num_accepted]
    if s > 0:
        residual = (p[rows, j] - q[rows, j]).clamp_min(0)
        # p <= q everywhere means p == q there: rejection had probability 0, any row is fine
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, j])
        target = torch.where((num_accepted < s)[:, None], residual, target)
    token = torch.multinomial(target / target.sum(-1, keepdim=True), 1, generator=generator)[:, 0]
    return num_accepted, token
