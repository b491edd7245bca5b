"""Registers the built-in tool-call parsers (lazily: nothing is imported until one is chosen)."""

from patchbay import hookimpl


@hookimpl
def register_tool_parsers(register):
    register(
        "hermes",
        "patchbay.plugins.tool_parsers.hermes:HermesToolParser",
        description="Hermes / Qwen: a JSON {name, arguments} object inside <tool_call> ... </tool_call>",
    )
    register(
        "llama3_json",
        "patchbay.plugins.tool_parsers.llama3_json:Llama3JsonToolParser",
        description="Llama 3.x: bare JSON {name, parameters} objects, ';'-separated, optional <|python_tag|>",
    )
    register(
        "mistral",
        "patchbay.plugins.tool_parsers.mistral:MistralToolParser",
        description="Mistral: [TOOL_CALLS] followed by a JSON list of {name, arguments} objects",
    )
