"""Metadata builders of the defective plugin."""

from dataclasses import dataclass

from patchbay.interfaces import CommonAttentionMetadata
from patchbay_example.metadata import PassthroughMetadataBuilder


class StaleBuilder(PassthroughMetadataBuilder):
    """Returns the metadata of the first batch it built for every later batch (a cache keyed on nothing)."""

    def build(self, common):
        if getattr(self, "_first", None) is None:
            self._first = super().build(common)
        return self._first


@dataclass
class KeyLengthMetadata:
    """The common metadata, plus how many keys each request attends to (a custom field)."""

    common: CommonAttentionMetadata
    key_lens: list[int]


class WrongFieldBuilder(PassthroughMetadataBuilder):
    """Adds ``key_lens``, but leaves a decode's own new token out of it."""

    def build(self, common):
        common = super().build(common)
        computed = common.num_computed_tokens_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        key_lens = [seq if seq - done > 1 else done for seq, done in zip(seq_lens, computed, strict=True)]
        return KeyLengthMetadata(common, key_lens)


@dataclass
class RenamedMetadata:
    """The common metadata under another name: no backend but its author's own can find it."""

    base: CommonAttentionMetadata


class NoCommonBuilder(PassthroughMetadataBuilder):
    """Named by no backend; its result carries the common metadata as ``.base``, not as ``.common``."""

    def build(self, common):
        return RenamedMetadata(super().build(common))
