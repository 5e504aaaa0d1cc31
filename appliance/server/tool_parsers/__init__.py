"""Tool-call parsers (``--tool-call-parser NAME``): one class per output format, found by name."""
from __future__ import annotations

from appliance.server.tool_parsers.base import ExtractedToolCalls, ToolCall, ToolParser, ToolStreamer
from appliance.server.tool_parsers.hermes import HermesToolParser
from appliance.server.tool_parsers.llama3_json import Llama3JsonToolParser
from appliance.server.tool_parsers.mistral import MistralToolParser
from appliance.server.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}") from None


__all__ = ["TOOL_PARSERS", "get_tool_parser", "ExtractedToolCalls", "ToolCall", "ToolParser", "ToolStreamer"]
