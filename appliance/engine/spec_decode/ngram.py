"""N-gram (prompt lookup) proposals over a request's own tokens. No torch (engine core)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids, min_n: int, max_n: int, k: int) -> list[int]:
    """The up to ``k`` tokens that followed the most recent earlier occurrence of the sequence's
    last ``n`` tokens, for the largest ``n`` in ``max_n..min_n`` that has one; [] when none does.

    The most recent occurrence, because in edited or repeated text the latest copy is the one the
    model is following. An occurrence must end before the last token (the suffix itself is not one)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        # windows starting at i = 0 .. size - 1 - n: each is followed by at least one token
        windows = sliding_window_view(tokens[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
