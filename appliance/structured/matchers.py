"""The engine side: one llguidance matcher per constrained sequence, the step's token bitmask, and
advancing the matchers with the sampled tokens. Torch-free: the bitmask is a numpy int32 array
``[rows, ceil(vocab / 32)]`` (bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed) that the
sampler applies to its logits.

Caches: the ``LLTokenizer`` (about a second to build from the HF tokenizer) is built once, on the
first constrained request; compiled grammars are kept by their text (a fresh matcher per text,
``deep_copy``'d for each sequence), so a schema sent again costs no compile.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from appliance.errors import InvalidRequestError
from appliance.sampling_params import StructuredOutputsParams
from appliance.structured.grammar import _WHAT, grammar_text, kind_of

log = logging.getLogger("appliance")

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


class StepMasks:
    """The bitmask of one step: ``rows[i]`` is the sampler row whose mask is ``bits[i]``."""

    def __init__(self, rows: list[int], bits: np.ndarray):
        self.rows, self.bits = rows, bits


class StructuredOutputs:
    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._lltok = None
        self._executor = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self.matchers: dict[str, object] = {}  # request id (one per sequence) -> LLMatcher
        self._worker: ThreadPoolExecutor | None = None
        self.stats = {"compile_s": 0.0, "mask_s": 0.0, "masks": 0}

    # -- compile -----------------------------------------------------------------------------
    def tokenizer(self):
        if self._lltok is None:
            import llguidance

            from appliance.engine.tokenizer import GGUFTokenizer

            try:
                eos = list(self.eos_token_ids) or None
                if type(self.hf_tokenizer) is GGUFTokenizer:  # what llguidance.hf does, without transformers
                    backend = self.hf_tokenizer.backend_tokenizer  # no padding or truncation (GGUFTokenizer.open)
                    self._lltok = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                         eos_token=eos if eos is not None else
                                                         self.hf_tokenizer.eos_token_id)
                else:
                    import llguidance.hf

                    self._lltok = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=eos)
            except Exception as e:  # noqa: BLE001 - e.g. a slow (Python) tokenizer
                raise InvalidRequestError(f"structured_outputs: this model's tokenizer cannot drive the grammar "
                                          f"engine ({e})", param="structured_outputs") from None
            self._executor = llguidance.LLExecutor()
        return self._lltok

    def compile(self, params: StructuredOutputsParams, field: str | None = None):
        """A fresh matcher for ``params`` (to ``deep_copy`` per sequence); InvalidRequestError
        naming ``field`` (default ``structured_outputs.<kind>``) when the grammar is invalid."""
        import time

        from llguidance import LLMatcher

        field = field or f"structured_outputs.{kind_of(params)}"
        text = grammar_text(params, field)
        m = self._compiled.get(text)
        if m is not None:
            self._compiled.move_to_end(text)
            return m
        t0 = time.perf_counter()
        m = LLMatcher(self.tokenizer(), text, log_level=0)
        self.stats["compile_s"] += time.perf_counter() - t0
        if m.is_error():
            raise InvalidRequestError(f"{field}: invalid {_WHAT[kind_of(params)]}: {m.get_error().strip()}",
                                      param=field)
        self._compiled[text] = m
        while len(self._compiled) > GRAMMAR_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return m

    # -- sequences ---------------------------------------------------------------------------
    def add(self, request_id: str, compiled) -> None:
        self.matchers[request_id] = compiled.deep_copy()

    def forget(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    @property
    def active(self) -> bool:
        return bool(self.matchers)

    def advance(self, request_id: str, token_id: int) -> bool:
        """Feed the sampled token to the sequence's matcher (once per sampled token: a preempted
        sequence is recomputed from its kept tokens, never resampled, so nothing is fed twice).
        True when the sequence must end here: the grammar took an EOS token. When the grammar is
        complete after an ordinary token, the next step's mask allows only EOS, so the sequence
        ends the way a free one does (its last token an EOS, which the detokenizer leaves out)."""
        m = self.matchers.get(request_id)
        if m is None:
            return False
        if not m.consume_token(token_id):
            # Cannot happen through the mask; a sequence that gets here has no valid continuation.
            log.error("%s: token %d refused by the grammar (%s); ending the sequence", request_id, token_id,
                      m.get_error())
            return True
        return token_id in self.eos_token_ids and m.is_stopped()

    # -- the step's bitmask --------------------------------------------------------------------
    def _fill(self, pairs: list[tuple[object, int]], bits: np.ndarray) -> None:
        import time

        t0 = time.perf_counter()
        # llguidance computes the masks of all matchers on its own threads, without the GIL.
        self._executor.unsafe_compute_mask_ptr(pairs, bits.ctypes.data, bits.shape[1] * 4, bits.shape[0])
        self.stats["mask_s"] += time.perf_counter() - t0
        self.stats["masks"] += len(pairs)

    def start_masks(self, request_ids: list[str]) -> Future | None:
        """Start computing the bitmask for the constrained ones among the step's sampling
        sequences (``request_ids``, in sampler row order) on a worker thread; the Future's result
        is a StepMasks (None when no row is constrained). Started before the model's forward pass,
        joined before sampling: the mask computation runs while the forward pass does."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self.matchers]
        if not rows:
            return None
        words = (self.tokenizer().vocab_size + 31) // 32
        bits = np.empty((len(rows), words), dtype=np.int32)
        pairs = [(self.matchers[request_ids[i]], j) for j, i in enumerate(rows)]
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="appliance-grammar")

        def run():
            self._fill(pairs, bits)
            return StepMasks(rows, bits)

        return self._worker.submit(run)

    def masks_now(self, request_ids: list[str]) -> StepMasks | None:
        f = self.start_masks(request_ids)
        return f.result() if f is not None else None
