"""What a step costs, learned while serving: seconds ~ fixed + per_token * tokens, fitted online to
the measured forward passes, and the prefill cap the scheduler derives from it so that running
decodes are not frozen behind new prompts (``itl_target``).

Why a fit and not a constant: the per-token cost depends on the model, the dtype, the host's cores
and what else runs there; one fixed token cap is either too small (throughput lost on a fast host)
or too large (multi-second stalls on a slow one). The fit is an exponentially weighted least squares
over recent steps, so it follows changes (longer contexts, a busier host). No torch here.
"""
from __future__ import annotations

import math

# A step that admits new prompts while decodes run may take at most this many times the decode-only
# step ("auto"); the tail inter-token latency then stays within ~3x its median.
AUTO_FACTOR = 2.5
# Fewer tokens than this per step would make prefill crawl (and cost more per token than it saves).
MIN_PREFILL_CHUNK = 32


def parse_itl_target(value) -> float | str | None:
    """``off`` (None), ``auto``, or a number of milliseconds (returned in seconds)."""
    if value is None or value == "off":
        return None
    if value == "auto":
        return "auto"
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = math.nan
    if not ms > 0 or math.isinf(ms):
        raise ValueError(f"itl_target must be 'off', 'auto' or a positive number of milliseconds; got {value!r}")
    return ms / 1000.0


class StepCostModel:
    """seconds = fixed + per_token * tokens, by exponentially weighted least squares."""

    def __init__(self, decay: float = 0.97, min_steps: int = 8):
        self.decay, self.min_steps = decay, min_steps
        self.n = 0
        self._w = self._t = self._y = self._tt = self._ty = 0.0
        self.frozen: tuple[float, float] | None = None  # (fixed, per_token) set by tests and benches

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        d = self.decay
        self._w = d * self._w + 1.0
        self._t = d * self._t + tokens
        self._y = d * self._y + seconds
        self._tt = d * self._tt + tokens * tokens
        self._ty = d * self._ty + tokens * seconds
        self.n += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before enough varied steps were seen."""
        if self.frozen is not None:
            return self.frozen
        if self.n < self.min_steps:
            return None
        mean_t, mean_y = self._t / self._w, self._y / self._w
        var = self._tt / self._w - mean_t * mean_t
        if var <= 1e-9 * max(1.0, mean_t * mean_t):  # every step the same size: no slope to fit
            return 0.0, mean_y / mean_t
        slope = (self._ty / self._w - mean_t * mean_y) / var
        if slope <= 0:  # noise swamped the size effect: charge everything per token
            return 0.0, mean_y / mean_t
        return max(0.0, mean_y - slope * mean_t), slope

    def predict(self, tokens: int) -> float | None:
        c = self.coefficients()
        return None if c is None else c[0] + c[1] * tokens

    def prefill_cap(self, num_decodes: int, target) -> int | None:
        """The most prefill tokens to put beside ``num_decodes`` decode tokens in one step so that
        the step stays within ``target`` seconds (``auto``: AUTO_FACTOR x the decode-only step).
        None when there is nothing to protect or no fit yet (no cap)."""
        if target is None or num_decodes <= 0:
            return None
        c = self.coefficients()
        if c is None:
            return None
        fixed, per_token = c
        decode_step = fixed + per_token * num_decodes
        budget = AUTO_FACTOR * decode_step if target == "auto" else float(target)
        return max(MIN_PREFILL_CHUNK, int((budget - decode_step) / per_token))
