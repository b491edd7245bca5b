"""The typed interfaces of the plugin kinds (the contract plugin authors code against)."""

from patchbay.interfaces.attention import (
    AttentionBackend,
    AttentionCapabilities,
    AttentionConfig,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from patchbay.interfaces.base import Capabilities, NoOptions, Plugin, ServingConfig
from patchbay.interfaces.drafter import (
    DraftBatch,
    Drafter,
    DrafterCapabilities,
    DrafterConfig,
    DrafterContext,
    DraftProposals,
    DraftStep,
)
from patchbay.interfaces.kv_connector import (
    KVConnector,
    KVConnectorCapabilities,
    KVConnectorConfig,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVShard,
    RequestView,
)
from patchbay.interfaces.lora import (
    NO_ADAPTER,
    LoRAKernel,
    LoRAKernelCapabilities,
    LoRAKernelConfig,
    LoRAMapping,
    LoRAResolveError,
    LoRAResolver,
    LoRAResolverCapabilities,
)
from patchbay.interfaces.sampler import (
    SAMPLING_PARAMS,
    RejectionSampler,
    Sampler,
    SamplerBase,
    SamplerCapabilities,
    SamplerConfig,
    SamplerOutput,
    SamplingMetadata,
    SpecDecodeMetadata,
)
from patchbay.interfaces.reasoning_parser import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningParserCapabilities,
    ReasoningSplit,
    ReasoningStream,
)
from patchbay.interfaces.structured_output import (
    GrammarCompileError,
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputCapabilities,
    StructuredOutputConfig,
    StructuredOutputParams,
)
from patchbay.interfaces.tool_parser import (
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallDeltaItem,
    ToolCallStream,
    ToolParser,
    ToolParserCapabilities,
)

__all__ = [
    "SAMPLING_PARAMS", "AttentionBackend", "AttentionCapabilities", "AttentionConfig", "AttentionImpl",
    "AttentionLayerSpec", "AttentionMetadataBuilder", "Capabilities", "CommonAttentionMetadata", "DraftBatch",
    "DraftProposals", "DraftStep", "Drafter", "DrafterCapabilities", "DrafterConfig", "DrafterContext", "KVConnector", "KVConnectorCapabilities",
    "KVConnectorConfig", "KVConnectorMetadata", "KVConnectorScheduler", "KVConnectorWorker", "KVShard", "NoOptions", "Plugin",
    "RejectionSampler", "RequestView", "Sampler", "SamplerBase", "SamplerCapabilities", "SamplerConfig",
    "SamplerOutput", "SamplingMetadata", "ServingConfig", "SpecDecodeMetadata",
    "GrammarCompileError", "GrammarMatcher", "StructuredOutputBackend", "StructuredOutputCapabilities",
    "StructuredOutputConfig", "StructuredOutputParams",
    "NO_ADAPTER", "LoRAKernel", "LoRAKernelCapabilities", "LoRAKernelConfig", "LoRAMapping", "LoRAResolveError",
    "LoRAResolver", "LoRAResolverCapabilities",
    "ParsedToolCalls", "ToolCall", "ToolCallDelta", "ToolCallDeltaItem", "ToolCallStream", "ToolParser",
    "ToolParserCapabilities",
    "ReasoningDelta", "ReasoningParser", "ReasoningParserCapabilities", "ReasoningSplit", "ReasoningStream",
]
