"""The conformance kit: one suite per plugin kind, for any implementation.

Plugin authors subclass the suite of their kind in their own tests (see
docs/plugin-guide.md); ``patchbay check KIND:NAME`` runs the same suite
against any installed plugin with no code from its author.
"""

from __future__ import annotations

from typing import Any

from patchbay.contract.registry import kind_of
from patchbay.testing.architecture import ArchitectureSuite
from patchbay.testing.attention import AttentionBackendSuite, MetadataBuilderSuite
from patchbay.testing.drafter import DrafterSuite
from patchbay.testing.kv_connector import KVConnectorSuite
from patchbay.testing.lora import LoRAKernelSuite, LoRAResolverSuite
from patchbay.testing.pooler import PoolerSuite
from patchbay.testing.reasoning_parser import ReasoningParserSuite
from patchbay.testing.sampler import SamplerSuite
from patchbay.testing.structured_output import StructuredOutputSuite
from patchbay.testing.suite import PluginSuite
from patchbay.testing.tool_parser import ToolParserSuite
from patchbay.testing.weight_format import WeightFormatSuite

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
    "weight_format": WeightFormatSuite,
    "architecture": ArchitectureSuite,
    "pooler": PoolerSuite,
}


def suite_for(kind: str, name: str, options: dict[str, Any] | None = None) -> type[PluginSuite]:
    """A ready-to-collect suite class testing the installed plugin ``kind:name``, with ``options`` (the
    suite's :attr:`~patchbay.testing.suite.PluginSuite.plugin_options`) if given."""
    base = SUITES[kind_of(kind).name]
    if options is not None and not base.takes_options:
        raise ValueError(f"the {kind_of(kind).name} suite builds plugins with their default options; it takes none")
    attributes: dict[str, Any] = {"plugin_name": name, "__test__": True}
    if options is not None:
        attributes["plugin_options"] = dict(options)
    return type(f"Test_{kind}_{name}".replace("-", "_"), (base,), attributes)


__all__ = [
    "SUITES",
    "ArchitectureSuite",
    "AttentionBackendSuite",
    "DrafterSuite",
    "KVConnectorSuite",
    "LoRAKernelSuite",
    "LoRAResolverSuite",
    "MetadataBuilderSuite",
    "PluginSuite",
    "PoolerSuite",
    "ReasoningParserSuite",
    "SamplerSuite",
    "StructuredOutputSuite",
    "ToolParserSuite",
    "WeightFormatSuite",
    "suite_for",
]
