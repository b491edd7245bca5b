"""``example_passthrough``: a metadata builder that hands the common metadata over unchanged."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import AttentionMetadataBuilder, Capabilities, CommonAttentionMetadata


class PassthroughOptions(BaseModel):
    """Options of ``attention: {metadata_builder: example_passthrough}``."""

    model_config = ConfigDict(extra="forbid")

    check_shapes: bool = True
    """Check the metadata's shapes before passing it on (cheap; catches runner bugs early)."""


class PassthroughMetadataBuilder(AttentionMetadataBuilder):
    """Returns the runner's CommonAttentionMetadata as is, for backends that read it directly."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = PassthroughOptions
    capabilities: ClassVar[Capabilities] = Capabilities(devices=("cpu", "cuda"))

    def build(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        if self.options.check_shapes:
            _check_shapes(common)
        return common


def _check_shapes(common: CommonAttentionMetadata) -> None:
    expected = {
        "query_start_loc": (common.num_reqs + 1,),
        "seq_lens": (common.num_reqs,),
        "num_computed_tokens_cpu": (common.num_reqs,),
    }
    for name, shape in expected.items():
        found = tuple(getattr(common, name).shape)
        if found != shape:
            raise ValueError(f"CommonAttentionMetadata.{name} has shape {found}, expected {shape}")
    if common.slot_mapping.shape[0] < common.num_actual_tokens:
        raise ValueError(
            f"slot_mapping has {common.slot_mapping.shape[0]} entries for {common.num_actual_tokens} tokens"
        )
    if common.block_table.shape[0] < common.num_reqs:
        raise ValueError(f"block_table has {common.block_table.shape[0]} rows for {common.num_reqs} requests")
