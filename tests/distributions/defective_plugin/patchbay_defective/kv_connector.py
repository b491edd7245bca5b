"""KV connectors of the defective plugin, each an example_memory wrong in one way."""

import dataclasses
from typing import ClassVar

import torch
from pydantic import BaseModel

from patchbay.interfaces import KVConnectorCapabilities

from patchbay_example.kv_connector import (
    InMemoryKVConnector,
    InMemoryOptions,
    InMemoryScheduler,
    InMemoryWorker,
)


class EarlySaveScheduler(InMemoryScheduler):
    """Treats a prefix-cache hit as computed at admission and saves it in that step."""

    def __init__(self, connector):
        super().__init__(connector)
        self._early = []

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        num_local = request.num_computed_tokens - num_external_tokens
        for index in range(num_local // self.block_size):
            key = self.connector.key(request.block_hashes[index])
            if key not in self.connector.store:
                self._early.append((key, block_ids[index]))

    def build_connector_meta(self, scheduled_request_ids):
        metadata = super().build_connector_meta(scheduled_request_ids)
        metadata.payload["early"], self._early = self._early, []
        return metadata


class EarlySaveWorker(InMemoryWorker):
    """Copies the "early" saves before the forward pass: blocks another request computes in this step."""

    def start_load_kv(self, metadata):
        super().start_load_kv(metadata)
        for key, block_id in metadata.payload.get("early", []):
            self.connector.store[key] = {
                layer: (keys[block_id].clone(), values[block_id].clone()) for layer, keys, values in self._layers()
            }


class EarlySaveConnector(InMemoryKVConnector):
    """example_memory that saves prefix-hit blocks in the step they are admitted, before they are computed."""

    def scheduler_side(self):
        return EarlySaveScheduler(self)

    def worker_side(self):
        return EarlySaveWorker(self)


class HoldingScheduler(InMemoryScheduler):
    """Holds every finished request's blocks, even when there is nothing to save."""

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        return True


class HoldsForeverConnector(InMemoryKVConnector):
    """example_memory whose request_finished always returns True; requests with nothing to save are never reported."""

    def scheduler_side(self):
        return HoldingScheduler(self)


class NoFaultHookConnector(InMemoryKVConnector):
    """example_memory without the kit's corrupt_entry fault hook."""

    corrupt_entry = None


class PathOptions(InMemoryOptions):
    """example_memory's options plus ``path`` (used as the store's namespace)."""

    path: str | None = None


class ZeroSavingWorker(InMemoryWorker):
    """Saves zeros instead of the block when no ``path`` is set."""

    def wait_for_save(self):
        if self.connector.options.path is not None:
            return super().wait_for_save()
        for request_id, block_hash, block_id in self._saves:
            self.connector.store[self.connector.key(block_hash)] = {
                layer: (torch.zeros_like(keys[block_id]), torch.zeros_like(values[block_id]))
                for layer, keys, values in self._layers()
            }
            self._finished_sending.add(request_id)
        self._saves = []


class BrokenDefaultsConnector(InMemoryKVConnector):
    """example_memory with a ``path`` option; without one (its default) it saves zeros."""

    Options: ClassVar[type[BaseModel]] = PathOptions

    def key(self, block_hash):
        # Entries saved under one path are not found under another (the path is part of the store's identity).
        return (f"{self.config.model_id}@{self.options.path}", self.config.block_size, bytes(block_hash))

    def worker_side(self):
        return ZeroSavingWorker(self)


class UnauthenticatedConnector(InMemoryKVConnector):
    """example_memory presented as a store other processes share, loading whatever an entry holds: nothing
    authenticates entries, so one rewritten by someone without the key loads (and every output is wrong)."""

    capabilities: ClassVar[KVConnectorCapabilities] = dataclasses.replace(
        InMemoryKVConnector.capabilities, cross_process=True
    )

    def corrupt_entry(self, block_hash, how):
        if how != "forged":
            return super().corrupt_entry(block_hash, how)
        key = self.key(block_hash)
        # Well-formed, same model, layout and block: different numbers, written without any key.
        self.store[key] = {
            layer: (torch.full_like(keys, 0.5), torch.full_like(values, -0.5))
            for layer, (keys, values) in self.store[key].items()
        }


class WritingConsumerScheduler(InMemoryScheduler):
    """Saves finished requests whatever the role, a consumer's included."""

    def request_finished(self, request, block_ids):
        computed_blocks = min(len(request.block_hashes), request.num_computed_tokens // self.block_size)
        saves = [
            (request.request_id, bytes(request.block_hashes[index]), block_ids[index])
            for index in range(computed_blocks)
            if self.connector.key(request.block_hashes[index]) not in self.connector.store
        ]
        self._saves.extend(saves)
        return bool(saves)


class WritingConsumerConnector(InMemoryKVConnector):
    """example_memory whose consumers write the store they should only read."""

    def scheduler_side(self):
        return WritingConsumerScheduler(self)
