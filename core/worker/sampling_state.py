"""Per-row sampling parameters of the persistent batch, as arrays, and the SamplingMetadata built from them.

Parameters are written once when a request joins the batch; each step
slices the rows it samples, so building a step's :class:`SamplingMetadata`
costs a few array gathers rather than a walk over every request's
parameters.  Tensors for parameters no sampled row uses are left ``None``,
so samplers skip that work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from patchbay.interfaces import SamplingMetadata
from patchbay.sampling_params import SamplingParams

_COLUMNS: dict[str, tuple[Any, float]] = {
    # name: (dtype, neutral value)
    "temperature": (np.float32, 0.0),
    "top_k": (np.int64, 0),
    "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0),
    "frequency_penalty": (np.float32, 0.0),
    "presence_penalty": (np.float32, 0.0),
    "repetition_penalty": (np.float32, 1.0),
}


class SamplingState:
    """Sampling parameters of every batch row, plus each seeded request's generator."""

    def __init__(self, max_num_reqs: int) -> None:
        self.columns = {
            name: np.full(max_num_reqs, neutral, dtype=dtype) for name, (dtype, neutral) in _COLUMNS.items()
        }
        self.generators: dict[str, torch.Generator] = {}
        """By request id, so reordering rows never mixes streams; kept while a preempted request is away."""
        self._states_before_step: dict[str, torch.Tensor] = {}
        """The generators' states before the current step drew from them, for :meth:`rewind`."""
        self._default_state_before_step: tuple[torch.Generator, torch.Tensor] | None = None
        """The device's default generator (unseeded rows draw from it) and its state when the step began."""

    @property
    def arrays(self) -> list[np.ndarray]:
        """The per-row arrays, for the batch to move and swap with its own."""
        return list(self.columns.values())

    def add(self, row: int, req_id: str, params: SamplingParams, device: torch.device) -> None:
        for name in _COLUMNS:
            self.columns[name][row] = getattr(params, name)
        if params.seed is None:
            self.generators.pop(req_id, None)
        elif req_id not in self.generators:  # a resumed request continues its stream where it left it
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
            self.generators[req_id] = generator

    def forget(self, req_id: str) -> None:
        """Drop a finished request's generator (one that only left the batch, preempted, keeps it)."""
        self.generators.pop(req_id, None)
        self._states_before_step.pop(req_id, None)

    def begin_step(self, device: torch.device) -> None:
        """A new step starts: what :meth:`rewind` restores is now taken by this step's :meth:`metadata`, and
        what :meth:`rewind_default` restores is the default generator's state now."""
        self._states_before_step.clear()
        generator = _default_generator(device)
        self._default_state_before_step = (generator, generator.get_state()) if generator is not None else None

    def rewind_default(self) -> None:
        """Put the device's default generator back where it was when the current step began.

        Ranks that replay a failed step then draw the unseeded rows' numbers
        alike, although one of them stopped drawing halfway through that step.
        """
        if self._default_state_before_step is not None:
            generator, state = self._default_state_before_step
            generator.set_state(state)

    def rewind(self, req_ids: Iterable[str]) -> None:
        """Put these requests' generators back where they were before the current step drew from them.

        A failed step replayed request by request then draws the same numbers again.
        """
        for req_id in req_ids:
            state = self._states_before_step.pop(req_id, None)
            if state is not None:
                self.generators[req_id].set_state(state)

    def metadata(
        self,
        rows: np.ndarray,
        req_ids: Sequence[str],
        params: Sequence[SamplingParams],
        *,
        output_token_ids: Callable[[], list[list[int]]],
        prompt_token_ids: Callable[[], torch.Tensor],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device,
    ) -> SamplingMetadata:
        """The :class:`SamplingMetadata` of ``rows`` (whose requests and parameters are given in the same order).

        ``output_token_ids`` and ``prompt_token_ids`` are called only when a
        row needs them (penalties, ``min_tokens``, bad words).
        """
        column = {name: values[rows] for name, values in self.columns.items()}

        def used(name: str) -> torch.Tensor | None:
            values = column[name]
            if np.all(values == _COLUMNS[name][1]):
                return None
            return torch.from_numpy(values).to(device)

        for req_id in req_ids:
            if req_id in self.generators and req_id not in self._states_before_step:
                self._states_before_step[req_id] = self.generators[req_id].get_state()
        temperature = column["temperature"]
        wanted_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        outputs_needed = (
            used("frequency_penalty") is not None
            or used("presence_penalty") is not None
            or used("repetition_penalty") is not None
            or any(p.min_tokens or p.bad_words_token_ids for p in params)
        )
        outputs = output_token_ids() if outputs_needed else []
        metadata = SamplingMetadata(
            temperature=torch.from_numpy(temperature).to(device),
            all_greedy=bool(np.all(temperature == 0.0)),
            all_random=bool(np.all(temperature > 0.0)),
            top_k=used("top_k"),
            top_p=used("top_p"),
            min_p=used("min_p"),
            generators={i: self.generators[req_id] for i, req_id in enumerate(req_ids) if req_id in self.generators},
            max_num_logprobs=max(wanted_logprobs) if wanted_logprobs else None,
            output_token_ids=outputs,
            frequency_penalties=used("frequency_penalty"),
            presence_penalties=used("presence_penalty"),
            repetition_penalties=used("repetition_penalty"),
        )
        if metadata.repetition_penalties is not None:
            metadata.prompt_token_ids = prompt_token_ids()
        if any(p.logit_bias for p in params):
            metadata.logit_bias = [dict(p.logit_bias) if p.logit_bias else None for p in params]
        if any(p.allowed_token_ids for p in params):
            mask = torch.zeros(len(params), vocab_size, dtype=torch.bool)
            for i, p in enumerate(params):
                if p.allowed_token_ids:
                    mask[i] = True
                    mask[i, list(p.allowed_token_ids)] = False
            metadata.allowed_token_ids_mask = mask.to(device)
        metadata.bad_words_token_ids = {i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids}
        for i, p in enumerate(params):
            if p.min_tokens and len(outputs[i]) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                metadata.min_tokens[i] = (p.min_tokens, stops)
        return metadata


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator that draws without an explicit one on ``device`` (``None`` where there is none to find)."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None
