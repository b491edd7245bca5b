"""One generation request as the scheduler tracks it: its tokens, progress and block hashes."""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from patchbay.interfaces import PoolingParams
from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.multimodal import ImageFeature


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    """Waiting while a KV connector loads its prompt blocks asynchronously; resumes once they arrive."""
    WAITING_FOR_GRAMMAR = enum.auto()
    """Waiting while its structured-output constraint compiles; schedulable once the grammar is ready."""
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    """The request failed alone (e.g. its constraint cannot compile); ``stop_reason`` holds the message."""

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
FINISHED_STATUS_BY_REASON = {reason: status for status, reason in _FINISH_REASONS.items()}
"""``"stop"`` / ``"length"`` / ``"abort"`` to the matching finished status."""


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """The chained hash of one full block: ``sha256(parent_hash + token bytes + extra_key)``.

    Deterministic across processes (no ``hash()`` seeding), so KV connectors in
    other processes compute the same keys.  ``parent_hash`` is ``None`` for the
    first block.  Token ids are packed as little-endian int64 and every block has
    the same number of tokens, so the concatenation is unambiguous.
    """
    digest = hashlib.sha256()
    if parent_hash is not None:
        digest.update(parent_hash)
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    digest.update(extra_key)
    return digest.digest()


@dataclass(frozen=True)
class PoolingRequest:
    """What makes a request a pooling one: it runs its prompt and finishes with the pooler's vector, sampling
    nothing."""

    params: PoolingParams
    token_type_ids: tuple[int, ...] | None = None
    """Each prompt token's segment (a BERT cross-encoder's query and document); ``None``: all 0."""
    whole_prompt: bool = False
    """The pooler reads positions other than the last: the prompt runs from its first token, never from a
    prefix-cache hit."""


class Request:
    """A request: prompt, sampling parameters, generated tokens and scheduling state.

    ``block_hashes[i]`` is the chained hash of tokens ``[i * block_size, (i + 1) * block_size)``
    of :attr:`all_token_ids`, kept up to date as output tokens are appended.
    ``cache_salt`` (a model identity, a tenant key, ...) enters the first block's
    hash, so requests with different salts never share cached blocks.  ``mm_features``
    are the prompt's images (placeholder ranges in order); each image's content hash
    enters the hash of every block its placeholders overlap.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        *,
        block_size: int = 16,
        cache_salt: str | bytes | None = None,
        mm_features: Sequence[ImageFeature] = (),
        pooling: PoolingRequest | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"request {request_id!r}: block_size must be positive, got {block_size}")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.block_size = block_size
        self.cache_salt = cache_salt.encode() if isinstance(cache_salt, str) else (cache_salt or b"")
        lora = getattr(sampling_params, "lora", None)
        if lora is not None:  # an adapter's KV differs from the base model's: its blocks never match another's
            self.cache_salt += b"\0lora:" + lora.encode()

        self.pooling = pooling
        """Set for a pooling request (an engine with a ``pooling:`` section), ``None`` for a generating one."""
        self.pooled: Any = None
        """The pooler's vector, once the prompt has run (a pooling request only)."""
        self.mm_features: list[ImageFeature] = sorted(mm_features, key=lambda feature: feature.offset)
        """The prompt's images, by placeholder offset."""
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        """Tokens whose KV is in the cache (as the scheduler counts them)."""
        self.spec_token_ids: list[int] = []
        """Draft tokens to verify at the next step."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        """The stop token id or stop string that finished the request (``None`` for EOS or length)."""
        self.num_preemptions = 0
        self.num_cached_tokens = -1
        """Prompt tokens found in the prefix cache when first scheduled (-1: not scheduled yet)."""
        self.grammar: Any = None
        """The compiled structured-output grammar, once ready (``None`` for unconstrained requests)."""
        self.grammar_future: Future[Any] | None = None
        """The compilation a ``WAITING_FOR_GRAMMAR`` request waits for."""
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position must run (prompt logprobs, or a pooler reading more than the last): no
        prefix-cache hit and no KV loaded from elsewhere may stand in for any of it."""
        return self.sampling_params.prompt_logprobs is not None or (
            self.pooling is not None and self.pooling.whole_prompt
        )

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` once finished, else ``None``."""
        return _FINISH_REASONS.get(self.status)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated tokens and hash any block they complete."""
        if isinstance(token_ids, int):  # a decode's one token, every step of every request
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            new = list(token_ids)
            self.output_token_ids.extend(new)
            self.all_token_ids.extend(new)
        if len(self.all_token_ids) >= (len(self.block_hashes) + 1) * self.block_size:
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        size = self.block_size
        for index in range(len(self.block_hashes), self.num_tokens // size):
            parent = self.block_hashes[-1] if self.block_hashes else None
            extra = self.cache_salt if index == 0 else b""
            if self.mm_features:
                start, end = index * size, (index + 1) * size
                extra += b"".join(
                    b"\0image:" + feature.content_hash.encode()
                    for feature in self.mm_features
                    if feature.overlaps(start, end)
                )
            tokens = self.all_token_ids[index * size : (index + 1) * size]
            self.block_hashes.append(hash_block_tokens(parent, tokens, extra))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
