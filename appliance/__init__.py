"""appliance: an Arm-CPU-first LLM inference engine and OpenAI-compatible server."""
from appliance.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # Lazy: `import appliance` stays cheap for the CLI and the runtime floor.
    if name == "LLM":
        from appliance.llm import LLM

        return LLM
    raise AttributeError(name)
