"""Structured outputs: constrained decoding through a grammar engine's token mask.

``grammar`` turns a ``StructuredOutputsParams`` (JSON schema, any JSON object, regex, choice, Lark or
GBNF grammar) into grammar text and validates it without a tokenizer (the server process does this
before queueing, so a bad constraint gets a 400 naming its field); ``matchers`` is the engine side
(one matcher per sequence, the step's bitmask computed while the forward pass runs, the matcher
advanced with each sampled token); ``requests`` maps the OpenAI / vLLM request fields
(``response_format``, ``structured_outputs``, ``guided_*``) to the params. The sampler applies the
mask (appliance/engine/sampler.py).

Why llguidance: it compiles a grammar lazily (JSON schemas in about a millisecond, no per-vocabulary
precomputation), computes a mask in tens of microseconds to a millisecond per token on the default
model's 49k vocabulary, releases the GIL while doing it (so the mask overlaps the forward pass), has
zero-dependency wheels for x86-64 and aarch64, and covers JSON schema, regex, Lark and GBNF in one
engine. bench/bench_structured.py measures it (and xgrammar when importable); see
bench/results/structured.txt for the numbers behind this choice.
"""
from appliance.structured.grammar import grammar_text, validate
from appliance.structured.matchers import StepMasks, StructuredOutputs

__all__ = ["StepMasks", "StructuredOutputs", "grammar_text", "validate"]
