"""The messages between the scheduler and the model runner, one pair per step.

The scheduler decides; the runner executes.  Each step the scheduler emits a
:class:`SchedulerOutput` describing only what *changed* since the previous
step, the runner applies it to its persistent batch, runs the model and
answers with a :class:`ModelRunnerOutput`, from which the scheduler advances
its requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

BlockIds = tuple[list[int], ...]
"""Block ids of one request, one list per KV-cache group."""


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (its state was dropped).

    The runner must run ``all_token_ids[num_computed_tokens:]`` over the
    coming steps; the first ``num_computed_tokens`` are already in the KV
    cache (prefix-cache hit, or loaded by a KV connector).
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated before a preemption; empty for a fresh request."""
    sampling_params: Any
    block_ids: BlockIds
    num_computed_tokens: int
    grammar: Any = None
    """The compiled structured-output grammar of a constrained request (``None``: unconstrained)."""
    mm_features: list[Any] = field(default_factory=list)
    """The prompt's images (:class:`patchbay.scheduling.multimodal.ImageFeature`, by placeholder offset)."""
    pooling: Any = None
    """A pooling request's :class:`patchbay.scheduling.request.PoolingRequest` (``None``: it generates)."""

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class CachedRequestData:
    """Requests already in the runner's batch that run again this step (parallel lists)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[BlockIds | None] = field(default_factory=list)
    """Blocks appended to each request's block table this step (``None``: none)."""
    num_computed_tokens: list[int] = field(default_factory=list)
    """Tokens in the cache before this step, as the scheduler counts them (drafts rejected last step excluded)."""
    new_token_ids: list[list[int]] = field(default_factory=list)
    """With overlapped batches (pipeline parallelism): per request, the tokens sampled since the runners last saw
    it, for the stages that do not sample (empty list: not told; the last stage appends its own samples)."""


@dataclass
class SchedulerOutput:
    """One step's schedule."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """Tokens each scheduled request runs this step (draft tokens included)."""
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens verified this step, by request; they are the last tokens scheduled for it."""
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished or aborted since the previous step: the runner drops their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests preempted this step: the runner drops their state; they come back as new."""
    reset_req_ids: set[str] = field(default_factory=set)
    """Requests whose KV failed to load: the runner drops their state; they are in ``scheduled_new_reqs``
    again, with ``num_computed_tokens`` rolled back to the first block that failed."""
    kv_connector_metadata: Any = None
    """What the KV connector's scheduler side built for its worker side this step (``None``: no connector)."""
    highest_block_ids: tuple[int, ...] = ()
    """Per KV-cache group, the highest block id allocated so far (empty: not told). Blocks above the previous
    step's figure are new this step, possibly for a request that only waits on a KV connector's load: a
    runner that leaves its pool unwritten zeroes them before anything (the connector's load included)
    writes to them."""
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    """Images to encode this step, by request: indices into its ``mm_features``. Each is encoded whole in the
    step whose chunk first reaches its placeholders, before the forward pass."""
    free_encoder_hashes: list[str] = field(default_factory=list)
    """Content hashes of encoder outputs no request needs any more: the runner drops them before this step's
    encoding (an image dropped and encoded again in one step is encoded afresh)."""
    drops_failed_step: bool = False
    """An empty step that drops a failed step's requests (``reset_req_ids``) from every rank's batch before they
    run again one by one: the random generators (theirs and the default) go back to where they were before the
    failed step, so each rank draws the same numbers again."""
    grammar_bitmasks: dict[str, Any] | None = None
    """With several ranks: the structured-output token bitmask rows rank 0 filled for this step, by request
    (numpy int32 ``[rows, ceil(vocab_size / 32)]``: one row per draft position, then the bonus row; fewer
    after a draft the grammar refuses), which every rank applies alike.  ``None``: one process, whose runner
    fills and applies them itself."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def without_grammars(self) -> SchedulerOutput:
        """This step as the other ranks get it: new requests without their compiled grammars.

        Grammars are rank 0's (they need not pickle); the other ranks use
        ``grammar_bitmasks`` instead.  ``self`` when no new request has one.
        """
        if all(request.grammar is None for request in self.scheduled_new_reqs):
            return self
        return replace(
            self,
            scheduled_new_reqs=[
                replace(request, grammar=None) if request.grammar is not None else request
                for request in self.scheduled_new_reqs
            ],
        )


@dataclass
class ModelRunnerOutput:
    """The runner's answer to one :class:`SchedulerOutput`."""

    req_ids: list[str]
    """Requests of the batch in row order."""
    sampled_token_ids: list[list[int]]
    """New tokens of each request (empty for a partial prefill; several with accepted drafts)."""
    logprobs: list[Any] | None = None
    prompt_logprobs: dict[str, Any] = field(default_factory=dict)
    draft_token_ids: list[list[int]] | None = None
    """Drafts proposed for the next step, by row."""
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    """Blocks a KV connector failed to load; the scheduler recomputes them."""
    pooled: dict[str, Any] = field(default_factory=dict)
    """Pooling requests whose prompt finished this step: the pooler's vector (float32, on the CPU), by request."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests that failed alone this step (a grammar backend error, say), with the message.

    They finish as ``error``.
    """
