"""Attention backends of the defective plugin: correct themselves, each reading a defective builder."""

import dataclasses

import torch

from patchbay_example.attention import ExampleDenseBackend, ExampleDenseImpl


class StaleBuilderReader(ExampleDenseBackend):
    """example_dense over the ``defect_stale`` builder."""

    metadata_builder = "defect_stale"


class KeyLengthImpl(ExampleDenseImpl):
    """example_dense attending to ``metadata.key_lens`` keys per request."""

    def forward(self, query, key, value, kv_cache, metadata):
        seq_lens = torch.tensor(metadata.key_lens, dtype=torch.int32)
        common = dataclasses.replace(metadata.common, seq_lens_cpu=seq_lens, seq_lens=seq_lens)
        return super().forward(query, key, value, kv_cache, common)


class WrongFieldReader(ExampleDenseBackend):
    """example_dense over the ``defect_wrong_field`` builder, reading its ``key_lens``."""

    metadata_builder = "defect_wrong_field"

    def make_impl(self, layer):
        impl = super().make_impl(layer)
        return KeyLengthImpl(layer, impl.scale)


class ZeroImpl(ExampleDenseImpl):
    """Returns zeros: wrong whatever builder it reads."""

    def forward(self, query, key, value, kv_cache, metadata):
        return torch.zeros_like(super().forward(query, key, value, kv_cache, metadata))


class BrokenForeignReader(ExampleDenseBackend):
    """A broken backend of this package that reads another package's builder (example_passthrough)."""

    metadata_builder = "example_passthrough"

    def make_impl(self, layer):
        impl = super().make_impl(layer)
        return ZeroImpl(layer, impl.scale)
