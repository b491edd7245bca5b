"""The conformance kit: one suite per plugin kind, for any implementation.

Plugin authors subclass the suite of their kind in their own tests (see
docs/plugin-guide.md); ``patchbay check KIND:NAME`` runs the same suite
against any installed plugin with no code from its author.
"""

from __future__ import annotations

from patchbay.contract.registry import kind_of
from patchbay.testing.attention import AttentionBackendSuite, MetadataBuilderSuite
from patchbay.testing.drafter import DrafterSuite
from patchbay.testing.kv_connector import KVConnectorSuite
from patchbay.testing.lora import LoRAKernelSuite, LoRAResolverSuite
from patchbay.testing.reasoning_parser import ReasoningParserSuite
from patchbay.testing.sampler import SamplerSuite
from patchbay.testing.structured_output import StructuredOutputSuite
from patchbay.testing.suite import PluginSuite
from patchbay.testing.tool_parser import ToolParserSuite

SUITES: dict[str, type[PluginSuite]] = {
    "attention": AttentionBackendSuite,
    "attention_metadata_builder": MetadataBuilderSuite,
    "sampler": SamplerSuite,
    "drafter": DrafterSuite,
    "kv_connector": KVConnectorSuite,
    "structured_output": StructuredOutputSuite,
    "lora_kernel": LoRAKernelSuite,
    "lora_resolver": LoRAResolverSuite,
    "tool_parser": ToolParserSuite,
    "reasoning_parser": ReasoningParserSuite,
}


def suite_for(kind: str, name: str) -> type[PluginSuite]:
    """A ready-to-collect suite class testing the installed plugin ``kind:name``."""
    base = SUITES[kind_of(kind).name]
    return type(f"Test_{kind}_{name}".replace("-", "_"), (base,), {"plugin_name": name, "__test__": True})


__all__ = [
    "SUITES",
    "AttentionBackendSuite",
    "DrafterSuite",
    "KVConnectorSuite",
    "LoRAKernelSuite",
    "LoRAResolverSuite",
    "MetadataBuilderSuite",
    "PluginSuite",
    "ReasoningParserSuite",
    "SamplerSuite",
    "StructuredOutputSuite",
    "ToolParserSuite",
    "suite_for",
]
