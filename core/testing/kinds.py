"""Registration-level conformance suites: a base suite per plugin kind whose numeric suite builds on one.

Each kind's numeric checks (dense-attention oracle, sampling statistics, ...)
extend these suites in their own modules; a kind whose suite needs nothing
shared (structured output) extends :class:`patchbay.testing.suite.PluginSuite` directly.
"""

from __future__ import annotations

from typing import ClassVar

from patchbay.interfaces import (
    AttentionCapabilities,
    AttentionConfig,
    Capabilities,
    DrafterCapabilities,
    DrafterConfig,
    KVConnectorCapabilities,
    KVConnectorConfig,
    LoRAKernelCapabilities,
    LoRAKernelConfig,
    LoRAResolverCapabilities,
    SamplerCapabilities,
    SamplerConfig,
    ServingConfig,
    WeightFormatCapabilities,
    WeightFormatConfig,
)
from patchbay.testing.suite import PluginSuite, _replace


class AttentionBackendBaseSuite(PluginSuite[AttentionCapabilities]):
    kind: ClassVar[str] = "attention"
    capabilities_class: ClassVar[type[Capabilities]] = AttentionCapabilities
    takes_options: ClassVar[bool] = False

    def supported_config(self, capabilities: AttentionCapabilities) -> AttentionConfig:
        head_size = capabilities.head_sizes[0] if capabilities.head_sizes else 64
        block_size = capabilities.block_sizes[0] if capabilities.block_sizes else 16 * capabilities.block_size_multiple
        return AttentionConfig(
            device=capabilities.devices[0],
            dtype=capabilities.dtypes[0],
            head_size=head_size,
            num_heads=8,
            num_kv_heads=8,
            block_size=block_size,
        )

    def unsupported_configs(self, capabilities: AttentionCapabilities) -> list[tuple[str, ServingConfig]]:
        found = super().unsupported_configs(capabilities)
        base = self.supported_config(capabilities)
        if capabilities.head_sizes is not None:
            found.append(("head size", _replace(base, head_size=max(capabilities.head_sizes) + 1)))
        if not capabilities.supports_gqa:
            found.append(("GQA", _replace(base, num_kv_heads=2)))
        if not capabilities.supports_sliding_window:
            found.append(("sliding window", _replace(base, sliding_window=128)))
        if not capabilities.supports_logits_soft_cap:
            found.append(("soft cap", _replace(base, logits_soft_cap=30.0)))
        if "int8" not in capabilities.cache_dtypes:
            found.append(("int8 cache", _replace(base, cache_dtype="int8")))
        return found


class MetadataBuilderBaseSuite(PluginSuite[Capabilities]):
    kind: ClassVar[str] = "attention_metadata_builder"
    takes_options: ClassVar[bool] = False


class SamplerBaseSuite(PluginSuite[SamplerCapabilities]):
    kind: ClassVar[str] = "sampler"
    capabilities_class: ClassVar[type[Capabilities]] = SamplerCapabilities

    def supported_config(self, capabilities: SamplerCapabilities) -> SamplerConfig:
        return SamplerConfig(device=capabilities.devices[0], dtype=capabilities.dtypes[0], role=capabilities.role)

    def unsupported_configs(self, capabilities: SamplerCapabilities) -> list[tuple[str, ServingConfig]]:
        found = super().unsupported_configs(capabilities)
        base = self.supported_config(capabilities)
        other_role = "verify" if capabilities.role == "sample" else "sample"
        found.append(("role", _replace(base, role=other_role)))
        if not capabilities.supports_random:
            found.append(("random sampling", _replace(base, random_sampling=True)))
        found.append(("unknown parameter", _replace(base, params_used=frozenset({"no_such_parameter"}))))
        return found


class DrafterBaseSuite(PluginSuite[DrafterCapabilities]):
    kind: ClassVar[str] = "drafter"
    capabilities_class: ClassVar[type[Capabilities]] = DrafterCapabilities

    def supported_config(self, capabilities: DrafterCapabilities) -> DrafterConfig:
        return DrafterConfig(device=capabilities.devices[0], dtype=capabilities.dtypes[0], num_speculative_tokens=1)

    def unsupported_configs(self, capabilities: DrafterCapabilities) -> list[tuple[str, ServingConfig]]:
        found = super().unsupported_configs(capabilities)
        base = self.supported_config(capabilities)
        found.append(("zero draft tokens", _replace(base, num_speculative_tokens=0)))
        if capabilities.max_num_speculative_tokens is not None:
            found.append(
                (
                    "too many draft tokens",
                    _replace(base, num_speculative_tokens=capabilities.max_num_speculative_tokens + 1),
                )
            )
        return found


class KVConnectorBaseSuite(PluginSuite[KVConnectorCapabilities]):
    kind: ClassVar[str] = "kv_connector"
    capabilities_class: ClassVar[type[Capabilities]] = KVConnectorCapabilities

    def supported_config(self, capabilities: KVConnectorCapabilities) -> KVConnectorConfig:
        return KVConnectorConfig(
            device=capabilities.devices[0], dtype=capabilities.dtypes[0], role=capabilities.roles[0]
        )

    def unsupported_configs(self, capabilities: KVConnectorCapabilities) -> list[tuple[str, ServingConfig]]:
        found = super().unsupported_configs(capabilities)
        base = self.supported_config(capabilities)
        for role in ("both", "producer", "consumer"):
            if role not in capabilities.roles:
                found.append((f"role {role}", _replace(base, role=role)))
        return found


class LoRAKernelBaseSuite(PluginSuite):
    kind: ClassVar[str] = "lora_kernel"
    capabilities_class: ClassVar[type[Capabilities]] = LoRAKernelCapabilities

    def supported_config(self, capabilities: LoRAKernelCapabilities) -> LoRAKernelConfig:
        rank = min(16, capabilities.max_lora_rank or 16)
        return LoRAKernelConfig(device=capabilities.devices[0], dtype=capabilities.dtypes[0], max_lora_rank=rank)

    def unsupported_configs(self, capabilities: LoRAKernelCapabilities) -> list[tuple[str, ServingConfig]]:
        found = super().unsupported_configs(capabilities)
        if capabilities.max_lora_rank is not None:
            base = self.supported_config(capabilities)
            found.append(("rank", _replace(base, max_lora_rank=capabilities.max_lora_rank + 1)))
        return found


class WeightFormatBaseSuite(PluginSuite[WeightFormatCapabilities]):
    kind: ClassVar[str] = "weight_format"
    capabilities_class: ClassVar[type[Capabilities]] = WeightFormatCapabilities

    def supported_config(self, capabilities: WeightFormatCapabilities) -> WeightFormatConfig:
        return WeightFormatConfig(device=capabilities.devices[0], dtype=capabilities.dtypes[0])

    def unsupported_configs(self, capabilities: WeightFormatCapabilities) -> list[tuple[str, ServingConfig]]:
        found = super().unsupported_configs(capabilities)
        if not capabilities.shards:
            found.append(("tensor parallelism", _replace(self.supported_config(capabilities), tensor_parallel_size=2)))
        return found


class LoRAResolverBaseSuite(PluginSuite):
    kind: ClassVar[str] = "lora_resolver"
    capabilities_class: ClassVar[type[Capabilities]] = LoRAResolverCapabilities
