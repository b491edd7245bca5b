"""Checks of a request against the model and run it is added to, before it is queued.

:class:`~patchbay.sampling_params.SamplingParams` checks what it can alone
(types, signs, finiteness); what depends on the model (its vocabulary, its
length limit) or the run (``model.max_logprobs``) is checked here, so that a
request that would fail inside a step is refused when it is added, with an
error naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from patchbay.sampling_params import SamplingParams


class RequestRejected(ValueError):
    """A request that cannot run on this engine; the message names the request and the field."""


@dataclass(frozen=True)
class AdmissionLimits:
    """What the engine can serve: vocabulary size, sequence length, logprobs per position."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    """Most logprobs a request may ask for per position (``model.max_logprobs``; ``-1`` there means the vocabulary)."""
    max_n: int | None = None
    """Most sequences one request may ask for (``scheduler.max_n``); ``None``: not checked here."""


def check_token_ids(request_id: str, field: str, token_ids: Iterable[object], vocab_size: int) -> None:
    """Every id is an ``int`` (not a bool or float) in ``[0, vocab_size)``; raises :class:`RequestRejected`."""
    wrong_type = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)]
    if wrong_type:
        raise RequestRejected(f"request {request_id!r}: {field} must be integers; got {wrong_type[:5]!r}")
    outside = [t for t in token_ids if not 0 <= t < vocab_size]  # type: ignore[operator]
    if outside:
        raise RequestRejected(
            f"request {request_id!r}: {field} has token ids outside the vocabulary (0..{vocab_size - 1}): {outside[:5]}"
        )


def check_num_sequences(request_id: object, params: SamplingParams, max_n: int) -> None:
    """Refuse a request whose ``n`` is over ``max_n`` (``scheduler.max_n``), before any of its sequences exists.

    Each of the ``n`` sequences is a request of its own in the engine, built
    when the request is added: ``n=10**7`` would build ten million of them.
    """
    if params.n > max_n:
        raise RequestRejected(
            f"request {request_id!r}: n={params.n} sequences exceeds scheduler.max_n={max_n}, "
            f"the most one request may ask for"
        )


def check_request(
    request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, limits: AdmissionLimits
) -> None:
    """Raise :class:`RequestRejected` naming ``request_id`` if this request cannot run under ``limits``."""
    vocab = limits.vocab_size
    if limits.max_n is not None:
        check_num_sequences(request_id, params, limits.max_n)
    if not prompt_token_ids:
        raise RequestRejected(f"request {request_id!r} has an empty prompt")
    check_token_ids(request_id, "the prompt", prompt_token_ids, vocab)
    if len(prompt_token_ids) > limits.max_model_len:
        raise RequestRejected(
            f"request {request_id!r}: prompt of {len(prompt_token_ids)} tokens exceeds "
            f"model.max_model_len={limits.max_model_len}"
        )
    for field in ("logprobs", "prompt_logprobs"):
        wanted = getattr(params, field)
        if wanted is not None and wanted > limits.max_logprobs:
            raise RequestRejected(
                f"request {request_id!r}: {field}={wanted} exceeds the most this run returns, "
                f"{limits.max_logprobs} (model.max_logprobs, at most the vocabulary size {vocab})"
            )
    if params.logit_bias:
        check_token_ids(request_id, "logit_bias", params.logit_bias, vocab)
    if params.allowed_token_ids is not None:
        check_token_ids(request_id, "allowed_token_ids", params.allowed_token_ids, vocab)
    for index, sequence in enumerate(params.bad_words_token_ids or []):
        if not sequence:
            raise RequestRejected(f"request {request_id!r}: bad_words_token_ids[{index}] is empty")
        check_token_ids(request_id, f"bad_words_token_ids[{index}]", sequence, vocab)
    check_token_ids(request_id, "stop_token_ids", params.stop_token_ids, vocab)


def effective_max_logprobs(setting: int, vocab_size: int) -> int:
    """``model.max_logprobs`` for a vocabulary: ``-1`` is the whole vocabulary; never more than it."""
    return vocab_size if setting == -1 else min(setting, vocab_size)
