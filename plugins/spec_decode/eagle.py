"""The ``eagle`` drafter (EAGLE-1): a one-layer draft model over the target's features, with its own paged KV cache.

EAGLE (Li et al., 2024) drafts at the feature level: the input at position
``p`` fuses the embedding of token ``p + 1`` with the target's final hidden
state ("feature") at ``p``; one decoder layer predicts the feature at
``p + 1``, which the target's lm head turns into a draft token and which
is fed back, with that token, to draft the next one.  Drafts come from the
draft vocabulary the layer was trained with (see
:class:`~patchbay.plugins.spec_decode.heads.DraftVocab`).

After each target step the drafter

1. runs its layer over the step's tokens, shifted by one (the input at
   position ``p`` is the token at ``p + 1``: the next row's token, or for a
   request's last accepted row the token just sampled), dropping the rows
   of rejected drafts.  This fills the drafter's KV cache, which mirrors
   the target's: one tensor shaped by the run's attention backend, indexed
   by the target's own block tables and slot mapping (positions match);
2. drafts ``K`` tokens per request autoregressively, one row per request
   per iteration, each at the next position.

Positions past the step's last row may lie in blocks the scheduler has not
allocated yet (or in block-table columns the step did not pass), so the
drafting iterations write them to *scratch blocks* past the end of the
target's pool: they are overwritten by the next step anyway, because the
target re-runs those positions with the verified tokens.  No draft is ever
cut short for a missing block.

Weights come from ``options.path`` (``patchbay-train-drafter eagle``);
without it the layer is randomly initialised (seeded): valid and lossless,
rarely accepted.  Known gap (only costs acceptance, never correctness):
with prefix caching, a shared block's last position holds the draft KV of
the request that filled it, whose next token may differ.

The ``eagle3`` drafter subclasses this one and changes only where the
cache-filling pass's features come from (``_target_inputs`` and the draft
model's ``target_features``), and the model it builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, PositiveInt

from patchbay.interfaces import (
    AttentionLayerSpec,
    CommonAttentionMetadata,
    DraftBatch,
    Drafter,
    DrafterCapabilities,
    DrafterContext,
    DraftProposals,
    DraftStep,
)
from patchbay.plugins.spec_decode.heads import (
    EagleDraftModel,
    Rotary,
    TargetParts,
    load_state,
    load_trained,
    target_parts,
    warn_vocab_size,
)

KIND = "eagle"
LAYER_NAME = "eagle.layer.self_attn"
INITIAL_SCRATCH_BLOCKS = 64


@dataclass
class FilledStep:
    """What filling the draft cache from one target step leaves for drafting (numpy arrays: one entry per request)."""

    lengths: np.ndarray
    """Tokens of each request so far."""
    step_seq_lens: np.ndarray
    """Tokens in the target's cache after the step, rejected drafts included."""
    num_run: np.ndarray
    """Rows the draft layer ran for each request (its accepted rows whose next token is known)."""
    first_positions: np.ndarray
    """Position of each request's first row in the step."""
    last_outputs: torch.Tensor
    """``[num_reqs, hidden]``: the layer's output at each request's last run row (zeros where none ran)."""

    def complete(self) -> np.ndarray:
        """Requests whose draft cache now reaches the row fed their last token: they can draft."""
        return (self.num_run > 0) & (self.first_positions + self.num_run == self.lengths - 1)


class EagleOptions(BaseModel):
    """Options of the ``eagle`` drafter."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    """Directory of a trained draft model (``config.json`` + ``model.safetensors``); ``auto``: the training
    command's default directory for the run's model; unset: a randomly initialised layer."""
    intermediate_size: PositiveInt | None = None
    """Untrained layer only: MLP width (default: the target's)."""
    seed: int = 0
    """Untrained layer only: initialisation seed."""


class EagleDrafter(Drafter):
    """EAGLE-1 drafting with a paged KV cache through the run's attention backend."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = EagleOptions
    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities(
        devices=("cpu", "cuda", "mps"),
        needs_hidden_states=True,
        needs_attention_metadata=True,
        reads_vocabulary_weights=True,
    )

    weights_kind: ClassVar[str] = KIND
    """The drafter's name in weight files (``config.json``'s ``kind``) and in the default weights directory."""
    untrained_options: ClassVar[tuple[str, ...]] = ("intermediate_size",)
    """Options that shape an untrained layer: an error with ``path``, whose ``config.json`` fixes the shapes."""
    draft_model: EagleDraftModel | None = None

    # -- setup -----------------------------------------------------------------------------

    def load(self, context: DrafterContext) -> None:
        """Build the draft model, its attention implementation and its KV cache (target pool + scratch blocks)."""
        options: EagleOptions = self.options  # type: ignore[assignment]
        parts = target_parts(context.model)
        if options.path is not None:
            untrained_only = [name for name in self.untrained_options if getattr(options, name) is not None]
            if untrained_only:
                raise ValueError(
                    f"{self.weights_kind} options: {', '.join(untrained_only)} is for an untrained "
                    "layer only; a trained path fixes it"
                )
            directory, config, state = load_trained(options.path, context.model, self.weights_kind)
            model = self._trained_model(config)
            load_state(model, state, directory)
            self.source: str = str(directory)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(options.seed)
                model = self._untrained_model(parts, context.model)
            self.source = f"untrained (random layer, seed {options.seed})"
        warn_vocab_size(self.config.vocab_size, parts.vocab_size)
        self.draft_model = model.to(device=context.device, dtype=context.dtype).eval()
        self.embeddings = parts.embeddings
        self.vocab = self.draft_model.vocab(parts.lm_head, limit=self.config.vocab_size)
        self.rotary = Rotary(parts)
        self.context = context
        layer = model.layer
        self.attention = context.attention_backend.make_impl(
            AttentionLayerSpec(
                layer_name=LAYER_NAME,
                num_heads=layer.num_heads,
                num_kv_heads=layer.num_kv_heads,
                head_size=layer.head_size,
                scale=layer.scale,
            )
        )
        self.num_real_blocks = context.num_blocks
        self.num_scratch_blocks = 0
        self.kv_cache = self._allocate_cache(INITIAL_SCRATCH_BLOCKS)

    def kv_cache_bytes_per_block(self) -> int:
        """One draft layer's page: the cache holds one block per block of the target's pool (plus scratch)."""
        if self.draft_model is None:
            return 0
        return self.kv_cache.nbytes // (self.num_real_blocks + self.num_scratch_blocks)

    def resize_kv_cache(self, num_blocks: int) -> None:
        """A fresh cache of ``num_blocks`` real blocks and the current scratch ones (nothing is cached yet)."""
        if self.draft_model is None:
            raise RuntimeError(f"{self.weights_kind} drafter resized before load()")
        del self.kv_cache  # nothing to keep (no step ran): free it before the new one is allocated
        self.num_real_blocks = num_blocks
        self.kv_cache = self._allocate_cache(self.num_scratch_blocks)

    def _trained_model(self, config: dict[str, Any]) -> EagleDraftModel:
        """The (still random) draft model of the shapes a trained ``config.json`` records."""
        return EagleDraftModel(
            config["hidden_size"],
            config["num_heads"],
            config["num_kv_heads"],
            config["head_size"],
            config["intermediate_size"],
            config["rms_norm_eps"],
            config.get("draft_vocab_size"),
        )

    def _untrained_model(self, parts: TargetParts, target: Any) -> EagleDraftModel:
        """A randomly initialised draft model for ``target`` (the caller seeds the generator)."""
        return EagleDraftModel.for_target(parts, self.options.intermediate_size)  # type: ignore[attr-defined]

    def _target_inputs(self, step: DraftStep, rows: torch.Tensor) -> torch.Tensor:
        """What the target gave for step rows ``rows``, before :meth:`EagleDraftModel.target_features`: its final
        hidden states."""
        return step.hidden_states[rows]

    def _allocate_cache(self, num_scratch_blocks: int) -> torch.Tensor:
        """A cache of the target pool's blocks plus ``num_scratch_blocks``, keeping the current cache's real blocks."""
        layer = self.draft_model.layer  # type: ignore[union-attr]
        backend = self.context.attention_backend
        shape = backend.kv_cache_shape(
            self.num_real_blocks + num_scratch_blocks, self.context.block_size, layer.num_kv_heads, layer.head_size
        )
        cache = torch.zeros(shape, dtype=self.context.dtype, device=self.context.device)
        old = getattr(self, "kv_cache", None)
        if old is not None:
            for new_part, old_part in zip(backend.split_kv_cache(cache), backend.split_kv_cache(old), strict=True):
                new_part[: self.num_real_blocks] = old_part[: self.num_real_blocks]
        self.num_scratch_blocks = num_scratch_blocks
        return cache

    # -- one step --------------------------------------------------------------------------

    def propose(self, batch: DraftBatch) -> DraftProposals:
        """Fill the draft cache from the target's step, then draft up to K tokens per request."""
        if self.draft_model is None:
            raise RuntimeError(f"{self.weights_kind} drafter used before load()")
        num_reqs = len(batch.req_ids)
        drafts: list[list[int]] = [[] for _ in range(num_reqs)]
        if num_reqs == 0:
            return DraftProposals(drafts)
        step = batch.step
        if step is None:
            raise ValueError(
                f"{self.weights_kind} needs DraftBatch.step (it declares needs_attention_metadata); got None"
            )
        with torch.inference_mode():
            filled = self._fill_cache(batch)
            if filled is not None:
                self._draft(batch, filled, drafts)
        return DraftProposals(drafts)

    def _fill_cache(self, batch: DraftBatch) -> FilledStep | None:
        """Run the layer over the step's accepted rows, shifted by one token (``None`` when no row ran).

        Example: a request ran ``[x, d1, d2, d3]`` at positions 10..13 and
        only ``d1`` was accepted, then ``r`` sampled (``num_rejected`` 2): it
        runs positions 10 and 11 with input tokens ``d1`` and ``r``.
        """
        step = batch.step
        assert step is not None
        common: CommonAttentionMetadata = step.attention_metadata
        num_reqs = len(batch.req_ids)
        query_start_loc = np.asarray(step.query_start_loc, dtype=np.int64)
        if len(query_start_loc) != num_reqs + 1:
            raise ValueError(
                f"{self.weights_kind}: DraftStep.query_start_loc has {len(query_start_loc) - 1} requests, "
                f"the DraftBatch {num_reqs}; they must be the same requests in the same order"
            )
        num_rows = np.diff(query_start_loc)
        step_seq_lens = common.seq_lens_cpu[:num_reqs].numpy().astype(np.int64)
        first_positions = step_seq_lens - num_rows
        lengths = np.fromiter((len(tokens) for tokens in batch.token_ids), dtype=np.int64, count=num_reqs)
        num_accepted_rows = num_rows - np.asarray(step.num_rejected, dtype=np.int64)
        # A row at position p needs the token at p + 1, which exists only up to the request's last token.
        num_run = np.clip(np.minimum(num_accepted_rows, lengths - 1 - first_positions), 0, None)
        total = int(num_run.sum())
        if total == 0:
            return None
        included = np.flatnonzero(num_run)
        cu_run = np.cumsum(num_run)
        # Step row of every run row: [4, 2] run of rows starting at [0, 6] -> [0, 1, 2, 3, 6, 7]
        offsets = np.arange(total) - np.repeat(cu_run - num_run, num_run)
        step_rows = np.repeat(query_start_loc[:-1], num_run) + offsets
        positions = np.repeat(first_positions, num_run) + offsets
        next_tokens = np.concatenate(
            [
                np.asarray(
                    batch.token_ids[i][first_positions[i] + 1 : first_positions[i] + 1 + num_run[i]], dtype=np.int64
                )
                for i in included
            ]
        )

        device = self.context.device
        rows_on_device = torch.from_numpy(step_rows).to(device)
        run_lens = num_run[included]
        query_start = np.zeros(len(included) + 1, dtype=np.int32)
        query_start[1:] = np.cumsum(run_lens)
        seq_lens = (first_positions[included] + run_lens).astype(np.int32)
        metadata = self._common(
            query_start,
            seq_lens,
            first_positions[included].astype(np.int32),
            common.block_table[torch.from_numpy(included).to(common.block_table.device)],
            common.slot_mapping[rows_on_device.to(common.slot_mapping.device)],
        )
        model = self.draft_model
        assert model is not None
        dtype = next(model.parameters()).dtype
        features = model.target_features(self._target_inputs(step, rows_on_device).to(dtype))
        output = self._run_layer(
            torch.from_numpy(next_tokens).to(device), features, torch.from_numpy(positions).to(device), metadata
        )
        last_rows = torch.from_numpy(cu_run[included] - 1).to(device)
        last_outputs = torch.zeros((num_reqs, output.shape[-1]), dtype=output.dtype, device=device)
        last_outputs[torch.from_numpy(included).to(device)] = output[last_rows]
        return FilledStep(lengths, step_seq_lens, num_run, first_positions, last_outputs)

    def _draft(self, batch: DraftBatch, filled: FilledStep, drafts: list[list[int]]) -> None:
        """Draft autoregressively for every request whose cache now reaches its last token."""
        step = batch.step
        assert step is not None
        lengths = filled.lengths
        num_drafts = np.minimum(batch.num_speculative_tokens, batch.max_model_len - lengths)
        num_drafts[~filled.complete()] = 0
        num_drafts[[index for index in batch.skip if index < len(num_drafts)]] = 0
        num_drafts = np.clip(num_drafts, 0, None)
        requests = np.flatnonzero(num_drafts)
        if len(requests) == 0:
            return
        device = self.context.device
        num_drafts = num_drafts[requests]
        # The request's last token sits at position lengths - 1; its draft layer row (the row fed that
        # token) at lengths - 2.  Iteration k (from 1) runs position lengths - 2 + k.
        last_positions = lengths[requests] - 2
        block_table = self._drafting_block_table(
            step.attention_metadata, requests, filled.step_seq_lens[requests], last_positions + num_drafts - 1
        )
        features = filled.last_outputs[torch.from_numpy(requests).to(device)]
        tokens = self.vocab.argmax(features)
        columns = [tokens]
        for iteration in range(1, int(num_drafts.max())):
            active = np.flatnonzero(num_drafts > iteration)
            active_on_device = torch.from_numpy(active).to(device)
            positions = last_positions[active] + iteration
            table = block_table[active]
            block_size = self.context.block_size
            slots = table[np.arange(len(active)), positions // block_size].astype(np.int64) * block_size
            slots += positions % block_size
            metadata = self._common(
                np.arange(len(active) + 1, dtype=np.int32),
                (positions + 1).astype(np.int32),
                positions.astype(np.int32),
                torch.from_numpy(table).to(device),
                torch.from_numpy(slots).to(device),
            )
            output = self._run_layer(
                tokens[active_on_device], features[active_on_device], torch.from_numpy(positions).to(device), metadata
            )
            features = torch.zeros_like(features)
            features[active_on_device] = output
            tokens = torch.full_like(tokens, -1)
            tokens[active_on_device] = self.vocab.argmax(output)
            columns.append(tokens)
        proposed = torch.stack(columns, dim=1).cpu().tolist()
        for request, count, row in zip(requests.tolist(), num_drafts.tolist(), proposed, strict=True):
            drafts[request] = row[:count]

    def _drafting_block_table(
        self,
        common: CommonAttentionMetadata,
        requests: np.ndarray,
        step_seq_lens: np.ndarray,
        last_draft_positions: np.ndarray,
    ) -> np.ndarray:
        """Block ids for the drafting requests, covering their draft positions; columns past the step's are scratch.

        Example, block size 4, a step that ended at position 9 (``seq_len`` 10,
        blocks ``[7, 3, 5]``), drafts up to position 13: columns 0-2 are the
        request's own, column 3 (positions 12-15) gets a scratch block ``S``::

            [7, 3, 5, S]
        """
        block_size = self.context.block_size
        own_columns = -(-step_seq_lens // block_size)
        width = int(last_draft_positions.max()) // block_size + 1
        step_table = common.block_table[torch.from_numpy(requests).to(common.block_table.device)].cpu().numpy()
        table = np.zeros((len(requests), max(width, step_table.shape[1])), dtype=np.int64)
        table[:, : step_table.shape[1]] = step_table
        column = np.arange(table.shape[1])
        scratch = column[None, :] >= own_columns[:, None]
        table[scratch] = 0
        needed = scratch & (column[None, :] <= (last_draft_positions // block_size)[:, None])
        num_needed = int(needed.sum())
        if num_needed > self.num_scratch_blocks:
            self.kv_cache = self._allocate_cache(max(num_needed, 2 * self.num_scratch_blocks))
        # Row-major order: each request's scratch blocks are consecutive ids past the target's pool.
        table[needed] = self.num_real_blocks + np.arange(num_needed)
        return table

    # -- pieces ----------------------------------------------------------------------------

    def _common(
        self,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        num_computed: np.ndarray,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> Any:
        """Build the backend's metadata for one draft-layer pass (``query_start_loc`` etc. as int32 numpy)."""
        device = self.context.device
        query_start_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
        seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        query_lens = np.diff(query_start_loc)
        common = CommonAttentionMetadata(
            query_start_loc=query_start_cpu.to(device),
            query_start_loc_cpu=query_start_cpu,
            seq_lens=seq_lens_cpu.to(device),
            seq_lens_cpu=seq_lens_cpu,
            num_computed_tokens_cpu=torch.from_numpy(num_computed.astype(np.int32)),
            block_table=block_table.to(device=device, dtype=torch.int32),
            slot_mapping=slot_mapping.to(device=device, dtype=torch.int64),
            num_reqs=len(seq_lens),
            num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=self.context.block_size,
        )
        return self.context.metadata_builder.build(common)

    def _run_layer(
        self, next_tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """The draft model over rows ``(token p+1, feature p)`` at ``positions``, attending through the paged cache."""
        model = self.draft_model
        assert model is not None
        dtype = next(model.parameters()).dtype
        x = model.fuse(self.embeddings(next_tokens).to(dtype), features.to(dtype))
        cos, sin = self.rotary(x, positions)
        query, key, value = model.layer.qkv(x, cos, sin)
        attention = self.attention.forward(query, key, value, self.kv_cache, metadata)
        return model.layer.finish(x, attention)
