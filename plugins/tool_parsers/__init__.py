"""Built-in tool-call parsers: Hermes/Qwen ``<tool_call>`` tags, Llama 3 JSON, Mistral ``[TOOL_CALLS]``."""
