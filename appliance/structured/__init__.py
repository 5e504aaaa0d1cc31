"""Structured outputs: constrained decoding through a grammar engine's token mask.

``grammar`` turns a ``StructuredOutputsParams`` (JSON schema, any JSON object, regex, choice, Lark or
GBNF grammar) into grammar text and validates it without a tokenizer (the server process does this
before queueing, so a bad constraint gets a 400 naming its field); ``matchers`` is the engine side
(one matcher per sequence, the step's bitmask computed while the forward pass runs, the matcher
advanced with each sampled token); ``requests`` maps the OpenAI / vLLM request fields
(``response_format``, ``structured_outputs``, ``guided_*``) to the params. The sampler applies the
mask (appliance/engine/sampler.py).

Why llguidance (bench/bench_structured.py, bench/results/structured.txt; llguidance 1.9.1 vs
xgrammar 0.2.9 on the default model's 49k-token tokenizer, one thread, on a loaded 2-core host):
- compile: llguidance builds a JSON-schema matcher in 1.3-1.7 ms, xgrammar in 54-193 ms. An API
  server sees a new schema with many requests (tool schemas, per-user response formats) and a
  short output each; 190 ms of compile is worth more than the whole mask cost of a typical
  constrained answer, and it would sit on the request's time to first token.
- mask per token: xgrammar is faster once compiled (2 us median vs 67 us), but 67 us x 16 rows is
  about 1 ms a step, computed on a worker thread while the forward pass (tens of ms) runs, because
  llguidance releases the GIL; what is left on the step is the join and applying the mask.
- packaging: llguidance is one zero-dependency wheel for x86-64 and aarch64 and covers JSON
  schema, regex, Lark and GBNF; xgrammar needs apache-tvm-ffi besides.
The engine-level overhead of a JSON schema was +1.8% per output token at 1 request and +14% at 16
in that (noisy, loaded) run; the 16-request figure includes the mask thread competing with the
forward pass for the same two cores.
"""
from appliance.structured.grammar import grammar_text, validate
from appliance.structured.matchers import StepMasks, StructuredOutputs

__all__ = ["StepMasks", "StructuredOutputs", "grammar_text", "validate"]
