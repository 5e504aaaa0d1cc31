"""How many drafts to verify this step: the expected tokens per second of the step, from the step
times measured at each size and each request's acceptance rate.

A verify chunk is nearly free only while the GEMMs still stream their weights once for all its
rows: the native float32 panel block on x86 AVX2 runs rows three at a time, so there a 4-token step
costs clearly more than a 3-token one (bench/results/spec_0.5b.txt, "step" columns). A request
whose drafts are rarely accepted (open-ended text under n-gram lookup) then gains from one draft and
loses from three; one whose drafts are copied text gains from every draft. The cost is whatever the
host and the model make it, so it is measured: the decode-only steps' forward times by the number of
tokens in the step (the least of the recent ones per size: a co-tenant only ever adds time). The
draft model's forwards (one per draft position, for all its requests at once) add their own
measured time.

A request's acceptance is modelled as independent per position with probability ``alpha`` (a
geometric run): its j-th draft is emitted with probability ``alpha ** j``. ``alpha`` is estimated
from its recent verified steps (accepted drafts against rejections, decayed per step) and an even
prior worth one observation. Every proposing request keeps its first draft (whether it speculates at
all is the acceptance pause's call, with its back-off; a verified first draft keeps the estimate
current: a policy that trimmed to zero would stop learning, and one early rejection then shut a
draft model off for tens of steps). Of the further drafts, for a fixed number in the step the best
choice is those with the highest ``alpha ** j`` (for each request a prefix of its proposal, as those
values fall with j); ``choose`` takes the most further drafts whose expected tokens per second is
within KEEP_MARGIN of the highest (none included). A size never measured counts as costing what the largest measured size below it does, so
it is tried once and then measured. No torch here.
"""
from __future__ import annotations

from collections import deque

# Step times kept per size (the least counts): recent enough to follow a host that got slower.
WINDOW = 8
# Acceptance counts decay by this much per verified step (a run of copied text ends, another starts).
DECAY = 0.8
# Drafts are kept up to the longest choice whose expected rate is within this fraction of the best.
KEEP_MARGIN = 0.05
# The prior: acceptance PRIOR_ALPHA, worth PRIOR_WEIGHT verified steps.
PRIOR_ALPHA = 0.5
PRIOR_WEIGHT = 1.0


class DraftLengthPolicy:
    def __init__(self):
        self._step_s: dict[int, deque] = {}
        self._draft_s: deque = deque(maxlen=WINDOW)
        self.num_trimmed = 0  # drafts proposed but not verified because they would not pay

    # -- measuring ----------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only step's forward time (each request's last token and its drafts)."""
        if num_tokens > 0 and seconds > 0:
            self._step_s.setdefault(num_tokens, deque(maxlen=WINDOW)).append(seconds)

    def observe_draft(self, seconds_per_forward: float) -> None:
        """The draft model's time for one forward (one draft position of every drafting request)."""
        if seconds_per_forward > 0:
            self._draft_s.append(seconds_per_forward)

    def step_time(self, num_tokens: int) -> float | None:
        """The step's forward time at ``num_tokens``, or at the largest measured size below it
        (optimistic: an untried size gets tried); None before any size up to it was measured."""
        for n in range(num_tokens, 0, -1):
            s = self._step_s.get(n)
            if s:
                return min(s)
        return None

    def draft_time(self) -> float:
        return min(self._draft_s) if self._draft_s else 0.0

    # -- acceptance ---------------------------------------------------------------------------
    @staticmethod
    def alpha(req) -> float:
        """The request's estimated probability that a draft is accepted, given the one before it was."""
        a, r = req.spec_run_counts
        return (a + PRIOR_WEIGHT * PRIOR_ALPHA) / (a + r + PRIOR_WEIGHT)

    @staticmethod
    def record(req, num_drafts: int, num_accepted: int) -> None:
        """A verified step: ``num_accepted`` drafts accepted, then a rejection unless all were."""
        a, r = req.spec_run_counts
        req.spec_run_counts = (DECAY * a + num_accepted, DECAY * r + (1.0 if num_accepted < num_drafts else 0.0))

    # -- choosing -----------------------------------------------------------------------------
    def choose(self, base: int, alphas: list[float], caps: list[int], draft_model: bool) -> list[int] | None:
        """Drafts per request (each from 1 to its ``caps``) for a step of ``base`` decode tokens, or
        None when the step time at ``base`` is not known yet (then every proposal is verified).
        Every proposing request keeps its first draft: whether a request speculates at all is the
        acceptance pause's call (``SpecDecoder.record``, with its back-off), and a verified first
        draft is what keeps its acceptance estimate current; the policy prices the drafts after it."""
        t0 = self.step_time(base + len(caps))
        if self.step_time(base) is None or t0 is None:
            return None
        d = self.draft_time() if draft_model else 0.0
        gains = sorted(((a ** j, i) for i, (a, c) in enumerate(zip(alphas, caps)) for j in range(2, c + 1)),
                       key=lambda g: -g[0])
        # expected tokens per second with the first m further drafts (m = 0: the first drafts only)
        first = float(base) + sum(alphas)
        rates = [first / (t0 + d)]
        tokens, kmax, counts = first, 1, [1] * len(caps)
        for m, (g, i) in enumerate(gains, start=1):
            tokens += g
            counts[i] += 1
            kmax = max(kmax, counts[i])
            rates.append(tokens / (self.step_time(base + len(caps) + m) + kmax * d))
        # the most drafts whose rate is within KEEP_MARGIN of the best: the times and the acceptance
        # model are estimates, and near a tie the measured speedups favoured the longer draft
        best = max(rates)
        best_m = max(m for m, r in enumerate(rates) if r >= (1 - KEEP_MARGIN) * best)
        out = [1] * len(caps)
        for _, i in gains[:best_m]:
            out[i] += 1
        self.num_trimmed += sum(caps) - sum(out)
        return out
