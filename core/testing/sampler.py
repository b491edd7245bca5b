"""Numeric conformance suite for samplers (role ``sample``) and rejection samplers (role ``verify``).

A sampler author's whole test file::

    from patchbay.testing import SamplerSuite

    class TestMySampler(SamplerSuite):
        plugin_name = "my_sampler"

Every case is built from constructed logits (no model) and checked against
the documented behaviour, written here as a plain per-row oracle
(:func:`reference_logits`, :func:`reference_probs`):

(a) allowed-token mask, (b) bad words, (c) ``min_tokens`` and logit bias,
(d) penalties -- repetition (positive logits divided, negative multiplied,
for tokens in the prompt or the output), frequency (minus penalty times the
count in the output), presence (minus penalty if in the output); then greedy
rows (temperature 0) take the argmax and random rows are divided by the
temperature, filtered by min-p (keep probability >= min_p * max), top-k
(keep the k largest, ties with the k-th kept, 0 disables) and top-p (keep the
smallest most-likely set whose mass reaches p, renormalised after top-k),
and sampled.

Logprobs are checked in the sampler's declared ``logprobs_mode`` (``raw``:
log-softmax of the logits as given; ``processed``: of the logits the token
was chosen from).  The sampled token's rank is 1 plus the number of tokens
with a strictly larger logprob, so tied tokens share the better rank and a
greedy token always has rank 1.

A test of one role skips on plugins of the other; a test of a parameter the
plugin does not list in ``supported_params`` skips, and so do random-sampling
tests when ``supports_random`` is false -- each with the reason.

Statistical tests run with fixed seeds, so their outcome is reproducible.
The thresholds bound how often a *correct* sampler would fail were the seed
drawn at random: chi-square tests reject at p < :data:`CHI_SQUARE_ALPHA`
(1e-4 per test); support tests ("every kept token is drawn at least once")
miss a kept token with probability below 1e-7.  Each ``check_*`` function
raises ``AssertionError`` on failure and can be called outside pytest.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
from pydantic import ValidationError

from patchbay.interfaces import (
    RejectionSampler,
    Sampler,
    SamplerBase,
    SamplerOutput,
    SamplingMetadata,
    SpecDecodeMetadata,
)
from patchbay.testing.kinds import SamplerBaseSuite
from patchbay.testing.suite import skip_not_declared

if TYPE_CHECKING:
    import torch

# torch is imported inside functions: this module is imported whenever pytest loads the patchbay plugin.

CHI_SQUARE_ALPHA = 1e-4
"""A chi-square test fails when its p-value is below this: the false-failure rate of one test."""

SEED = 20240611
"""Seed of every constructed input."""

DEFAULT_GENERATOR_SEED = 7919
"""Seed of the default generator during the checks; not :data:`SEED`, whose stream the inputs are drawn from
(a sampler drawing the very uniforms that chose the drafts would be correlated with them)."""

NEG_INF = float("-inf")


# -- per-row parameters, and the metadata the runner would build from them ----------------------------


@dataclass(frozen=True)
class RowParams:
    """One row's sampling parameters and history, in the units of :class:`~patchbay.sampling_params.SamplingParams`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    output: tuple[int, ...] = ()
    """Tokens generated so far."""
    prompt: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_tokens: tuple[int, frozenset[int]] | None = None
    """(min_tokens, stop token ids)."""


def build_metadata(
    rows: Sequence[RowParams], vocab: int, *, device: str = "cpu", max_num_logprobs: int | None = None
) -> SamplingMetadata:
    """The :class:`SamplingMetadata` the runner builds for ``rows``, with fresh generators for seeded rows.

    As in the runner, a tensor is ``None`` when no row uses its parameter,
    and histories are given when any row needs them.
    """
    import torch

    def column(name: str, neutral: float, dtype: torch.dtype) -> torch.Tensor | None:
        values = [getattr(row, name) for row in rows]
        if all(value == neutral for value in values):
            return None
        return torch.tensor(values, dtype=dtype, device=device)

    temperature = torch.tensor([row.temperature for row in rows], dtype=torch.float32, device=device)
    repetition = column("repetition_penalty", 1.0, torch.float32)
    needs_history = any(row.output or row.bad_words or row.min_tokens for row in rows) or (
        repetition is not None or any(row.frequency_penalty or row.presence_penalty for row in rows)
    )
    metadata = SamplingMetadata(
        temperature=temperature,
        all_greedy=all(row.temperature == 0 for row in rows),
        all_random=all(row.temperature > 0 for row in rows),
        top_k=column("top_k", 0, torch.int64),
        top_p=column("top_p", 1.0, torch.float32),
        min_p=column("min_p", 0.0, torch.float32),
        generators={i: _generator(row.seed, device) for i, row in enumerate(rows) if row.seed is not None},
        max_num_logprobs=max_num_logprobs,
        output_token_ids=[list(row.output) for row in rows] if needs_history else [],
        frequency_penalties=column("frequency_penalty", 0.0, torch.float32),
        presence_penalties=column("presence_penalty", 0.0, torch.float32),
        repetition_penalties=repetition,
    )
    if repetition is not None:
        width = max(1, max(len(row.prompt) for row in rows))
        metadata.prompt_token_ids = torch.tensor(
            [list(row.prompt) + [vocab] * (width - len(row.prompt)) for row in rows], dtype=torch.int64, device=device
        )
    if any(row.logit_bias for row in rows):
        metadata.logit_bias = [dict(row.logit_bias) if row.logit_bias else None for row in rows]
    if any(row.allowed_token_ids is not None for row in rows):
        mask = torch.zeros(len(rows), vocab, dtype=torch.bool)
        for i, row in enumerate(rows):
            if row.allowed_token_ids is not None:
                mask[i] = True
                mask[i, list(row.allowed_token_ids)] = False
        metadata.allowed_token_ids_mask = mask.to(device)
    metadata.bad_words_token_ids = {
        i: [list(word) for word in row.bad_words] for i, row in enumerate(rows) if row.bad_words
    }
    metadata.min_tokens = {
        i: (row.min_tokens[0], set(row.min_tokens[1])) for i, row in enumerate(rows) if row.min_tokens is not None
    }
    return metadata


def _generator(seed: int, device: str) -> torch.Generator:
    import torch

    return torch.Generator(device=device).manual_seed(seed)


@contextlib.contextmanager
def fixed_default_seed(seed: int = DEFAULT_GENERATOR_SEED) -> Iterator[None]:
    """Seed the default generators for the block, restoring their state afterwards."""
    import torch

    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []):
        torch.manual_seed(seed)
        yield


# -- the oracle: the documented processing, one row at a time in float64 ------------------------------


def reference_logits(logits: Sequence[float], row: RowParams) -> list[float]:
    """Steps (a) to (d) on one row: the logits greedy rows take the argmax of."""
    out = [float(value) for value in logits]
    output = list(row.output)
    if row.allowed_token_ids is not None:
        out = [value if token in row.allowed_token_ids else NEG_INF for token, value in enumerate(out)]
    for word in row.bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            out[word[-1]] = NEG_INF
    if row.min_tokens is not None and len(output) < row.min_tokens[0]:
        for token in row.min_tokens[1]:
            out[token] = NEG_INF
    for token, bias in (row.logit_bias or {}).items():
        out[token] += bias
    seen = set(output) | set(row.prompt)
    for token in range(len(out)):
        if token in seen and row.repetition_penalty != 1.0:
            penalty = row.repetition_penalty
            out[token] = out[token] / penalty if out[token] > 0 else out[token] * penalty
        out[token] -= row.frequency_penalty * output.count(token)
        if token in output:
            out[token] -= row.presence_penalty
    return out


def reference_probs(logits: Sequence[float], row: RowParams) -> list[float]:
    """The distribution a row's token is drawn from (one-hot on the argmax for greedy rows)."""
    z = reference_logits(logits, row)
    if row.temperature == 0:
        best = max(range(len(z)), key=lambda token: (z[token], -token))
        return [1.0 if token == best else 0.0 for token in range(len(z))]
    z = [value / row.temperature for value in z]
    if row.min_p > 0:
        probs = _softmax(z)
        threshold = row.min_p * max(probs)
        z = [value if prob >= threshold else NEG_INF for value, prob in zip(z, probs, strict=True)]
    if 0 < row.top_k < len(z):
        kth = sorted(z, reverse=True)[row.top_k - 1]
        z = [value if value >= kth else NEG_INF for value in z]
    if row.top_p < 1.0:
        probs = _softmax(z)
        mass, kept = 0.0, set[int]()
        for token in sorted(range(len(z)), key=lambda t: -probs[t]):
            if kept and mass >= row.top_p:
                break
            kept.add(token)
            mass += probs[token]
        z = [value if token in kept else NEG_INF for token, value in enumerate(z)]
    return _softmax(z)


def _softmax(values: Sequence[float]) -> list[float]:
    top = max(values)
    weights = [math.exp(value - top) for value in values]
    total = sum(weights)
    return [weight / total for weight in weights]


def _log(probs: Sequence[float]) -> list[float]:
    return [math.log(prob) if prob > 0 else NEG_INF for prob in probs]


def chi_square_p_value(observed: Sequence[int], expected_probs: Sequence[float]) -> float:
    """Pearson's chi-square goodness-of-fit p-value of ``observed`` counts against ``expected_probs``.

    Categories expected fewer than 5 times are pooled into one.  Tokens of
    zero probability are excluded (check separately that none was drawn).
    """
    import torch

    total = sum(observed)
    pairs = [(count, prob * total) for count, prob in zip(observed, expected_probs, strict=True) if prob > 0]
    bins = [pair for pair in pairs if pair[1] >= 5]
    small = [pair for pair in pairs if pair[1] < 5]
    if small:
        bins.append((sum(count for count, _ in small), sum(expected for _, expected in small)))
    if len(bins) < 2:
        return 1.0
    statistic = sum((count - expected) ** 2 / expected for count, expected in bins)
    half_df = torch.tensor((len(bins) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(half_df, torch.tensor(statistic / 2, dtype=torch.float64)))


def assert_distribution(tokens: Sequence[int], expected_probs: Sequence[float], label: str) -> None:
    """``tokens`` are draws from ``expected_probs``: none of zero probability, and chi-square p >= the threshold."""
    counts = [0] * len(expected_probs)
    for token in tokens:
        counts[token] += 1
    impossible = [token for token, count in enumerate(counts) if count and expected_probs[token] == 0]
    assert not impossible, f"{label}: drew tokens {impossible} whose probability is 0"
    p_value = chi_square_p_value(counts, expected_probs)
    expected = [round(prob * len(tokens), 1) for prob in expected_probs]
    assert p_value >= CHI_SQUARE_ALPHA, (
        f"{label}: frequencies do not match the processed distribution (chi-square p = {p_value:.3g} < "
        f"{CHI_SQUARE_ALPHA}); observed {counts}, expected {expected}"
    )


# -- running a sampler -----------------------------------------------------------------------------


def sample_tokens(sampler: Sampler, logits: torch.Tensor, metadata: SamplingMetadata) -> list[int]:
    """Run ``sampler`` and return one token per row, checking the output's shape and dtype on the way."""
    import torch

    before = logits.clone()
    output = sampler.sample(logits, metadata)
    assert isinstance(output, SamplerOutput), f"sample() returned {type(output).__name__}, not SamplerOutput"
    sampled = output.sampled_token_ids
    assert sampled.shape == (logits.shape[0], 1), f"sampled_token_ids has shape {tuple(sampled.shape)}"
    assert sampled.dtype == torch.int64, f"sampled_token_ids has dtype {sampled.dtype}, expected int64"
    assert torch.equal(logits, before), "sample() modified the logits in place"
    tokens = sampled[:, 0].tolist()
    assert all(0 <= token < logits.shape[1] for token in tokens), "sampled a token id outside the vocabulary"
    return tokens


def _logits(rows: Sequence[Sequence[float]], device: str) -> torch.Tensor:
    import torch

    return torch.tensor(rows, dtype=torch.float32, device=device)


def _noise(shape: tuple[int, ...], seed: int = SEED) -> torch.Tensor:
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


# -- role "sample": greedy and temperature --------------------------------------------------------------


def check_greedy_rows(sampler: Sampler, *, random_rows: bool = True, device: str = "cpu") -> None:
    """Greedy rows take the argmax of their logits, also when random rows share the batch."""
    import torch

    logits = _noise((64, 100)) * 3
    is_random = (torch.rand(64, generator=torch.Generator().manual_seed(SEED)) < 0.5).tolist()
    rows = [RowParams(temperature=1.0 if (random_rows and random) else 0.0) for random in is_random]
    with fixed_default_seed():
        tokens = sample_tokens(sampler, logits.to(device), build_metadata(rows, 100, device=device))
    argmax = logits.argmax(dim=-1).tolist()
    wrong = [i for i, row in enumerate(rows) if row.temperature == 0 and tokens[i] != argmax[i]]
    assert not wrong, f"greedy rows {wrong} did not take the argmax: got {[tokens[i] for i in wrong]}"


def check_low_temperature_is_greedy(sampler: Sampler, *, device: str = "cpu") -> None:
    """Temperature 1e-4 picks the argmax (each top logit leads by >= 0.05: other tokens have probability < e^-500)."""
    logits = _noise((256, 64)) * 2
    best = logits.argmax(dim=-1)
    logits[range(256), best] += 0.05
    rows = [RowParams(temperature=1e-4)] * 256
    with fixed_default_seed():
        tokens = sample_tokens(sampler, logits.to(device), build_metadata(rows, 64, device=device))
    wrong = sum(token != expected for token, expected in zip(tokens, best.tolist(), strict=True))
    assert wrong == 0, f"temperature 1e-4 missed the argmax in {wrong} of 256 rows"


# -- role "sample": the support of top-k, top-p and min-p ---------------------------------------------

SUPPORT_PROBS = (0.3, 0.25, 0.2, 0.1, 0.07, 0.05, 0.02, 0.01)
"""Token probabilities of the support tests, most likely first (cumulative .3 .55 .75 .85 .92 .97 .99 1)."""

SUPPORT_CASES: dict[str, list[tuple[RowParams, int]]] = {
    # (row parameters, how many of the most likely tokens must remain); no case sits near a boundary.
    "top_k": [(RowParams(temperature=1.0, top_k=k), size) for k, size in [(1, 1), (3, 3), (6, 6), (0, 8), (13, 8)]],
    "top_p": [
        (RowParams(temperature=1.0, top_p=p), size)
        for p, size in [(0.2, 1), (0.31, 2), (0.5, 2), (0.6, 3), (0.8, 4), (0.95, 6), (1.0, 8)]
    ],
    # min-p is relative to the largest probability: 0.05 keeps p >= 0.015 (7 tokens), not p >= 0.05.
    "min_p": [
        (RowParams(temperature=1.0, min_p=m), size)
        for m, size in [(1.0, 1), (0.9, 1), (0.5, 3), (0.3, 4), (0.2, 5), (0.05, 7), (0.0, 8)]
    ],
}

SUPPORT_REPEATS = 2500
"""Rows per support case; the least likely kept token (renormalised probability >= 0.01) is missed with
probability below 0.99**2500 < 1.3e-11 per case."""


def check_support(sampler: Sampler, param: str, *, device: str = "cpu") -> None:
    """Random rows of one filter keep exactly the documented tokens: none outside is drawn, every one inside is.

    Each row is :data:`SUPPORT_PROBS` in a random token order, shifted by a
    random constant (so only probabilities, not raw logits, can decide).
    """
    import torch

    cases = SUPPORT_CASES[param]
    num_rows = len(cases) * SUPPORT_REPEATS
    vocab = len(SUPPORT_PROBS)
    generator = torch.Generator().manual_seed(SEED)
    order = torch.rand(num_rows, vocab, generator=generator).argsort(dim=-1)  # order[i, r]: token of rank r
    shift = torch.rand(num_rows, 1, generator=generator) * 6 - 3
    logits = torch.empty(num_rows, vocab).scatter_(1, order, torch.tensor(SUPPORT_PROBS).log().expand(num_rows, -1))
    rows = [case for case, _ in cases for _ in range(SUPPORT_REPEATS)]
    with fixed_default_seed():
        tokens = sample_tokens(sampler, (logits + shift).to(device), build_metadata(rows, vocab, device=device))
    rank_of = order.argsort(dim=-1)
    ranks = rank_of.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
    for index, (row, size) in enumerate(cases):
        drawn = set(ranks[index * SUPPORT_REPEATS : (index + 1) * SUPPORT_REPEATS])
        value = getattr(row, param)
        outside = sorted(rank for rank in drawn if rank >= size)
        assert not outside, (
            f"{param}={value}: drew the tokens ranked {[r + 1 for r in outside]} (1 = most likely); "
            f"only the {size} most likely of {list(SUPPORT_PROBS)} may be drawn"
        )
        missing = sorted(set(range(size)) - drawn)
        assert not missing, (
            f"{param}={value}: never drew the tokens ranked {[r + 1 for r in missing]} in "
            f"{SUPPORT_REPEATS} rows; the {size} most likely of {list(SUPPORT_PROBS)} must remain"
        )


# -- role "sample": frequencies -------------------------------------------------------------------------

FREQUENCY_LOGITS = (2.0, 1.6, 1.3, 1.0, 0.7, 0.5, 0.2, 0.0, -0.3, -0.8, -1.5, -2.5)


@dataclass(frozen=True)
class FrequencyCase:
    """One chi-square test: every row samples :data:`FREQUENCY_LOGITS` with ``row``."""

    row: RowParams
    params: frozenset[str]
    """Parameters the case needs the sampler to support."""
    num_rows: int = 20000
    seeded: bool = False
    """Give every row its own seeded generator."""


FREQUENCY_CASES: dict[str, FrequencyCase] = {
    "temperature_0.6": FrequencyCase(RowParams(temperature=0.6), frozenset()),
    "temperature_1.7": FrequencyCase(RowParams(temperature=1.7), frozenset()),
    "top_p_0.75": FrequencyCase(RowParams(temperature=0.8, top_p=0.75), frozenset({"top_p"})),
    "top_k_and_min_p": FrequencyCase(RowParams(temperature=1.3, top_k=6, min_p=0.25), frozenset({"top_k", "min_p"})),
    "seeded_rows": FrequencyCase(RowParams(temperature=0.9), frozenset({"seed"}), num_rows=4000, seeded=True),
}


def check_frequencies(
    sampler: Sampler,
    case: FrequencyCase,
    *,
    label: str = "",
    device: str = "cpu",
    max_num_logprobs: int | None = None,
) -> None:
    """Many rows with the same logits and parameters: token frequencies match :func:`reference_probs`.

    With ``max_num_logprobs`` the batch also asks for logprobs, which must not change what is drawn.
    """
    import torch

    vocab = len(FREQUENCY_LOGITS)
    rows = [replace(case.row, seed=SEED + i) if case.seeded else case.row for i in range(case.num_rows)]
    logits = torch.tensor(FREQUENCY_LOGITS).expand(case.num_rows, -1).contiguous()
    metadata = build_metadata(rows, vocab, device=device, max_num_logprobs=max_num_logprobs)
    with fixed_default_seed():
        tokens = sample_tokens(sampler, logits.to(device), metadata)
    assert_distribution(tokens, reference_probs(FREQUENCY_LOGITS, case.row), label or _describe(case.row))


def check_masked_rows(
    sampler: Sampler, *, random_rows: bool = True, logprobs: bool = False, device: str = "cpu"
) -> None:
    """Rows whose logits are -inf outside a mask (a grammar's bitmask, allowed_token_ids) never yield NaN nor a
    masked token, greedy or random, with one allowed token or many, and with logprobs when the sampler has them."""
    import torch

    vocab, num_rows = 64, 48
    logits = _noise((num_rows, vocab)) * 2
    generator = torch.Generator().manual_seed(SEED + 1)
    for row in range(num_rows):
        kept = torch.randperm(vocab, generator=generator)[: 1 + row % 7]  # 1 to 7 allowed tokens
        masked = torch.ones(vocab, dtype=torch.bool)
        masked[kept] = False
        logits[row, masked] = NEG_INF
    rows = [
        RowParams(temperature=(0.0 if i % 3 == 0 or not random_rows else 0.5 + 0.25 * (i % 4))) for i in range(num_rows)
    ]
    metadata = build_metadata(rows, vocab, device=device, max_num_logprobs=2 if logprobs else None)
    label = "rows with -inf (masked) logits" + (" and logprobs" if logprobs else "")
    for attempt in range(3):
        with fixed_default_seed(DEFAULT_GENERATOR_SEED + attempt):
            try:
                output = sampler.sample(logits.to(device), metadata)
            except Exception as exc:
                raise AssertionError(f"{label}: sample() raised {type(exc).__name__}: {exc}") from exc
        tokens = output.sampled_token_ids[:, 0].tolist()
        invalid = [(i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab or logits[i, t] == NEG_INF]
        assert not invalid, (
            f"{label}: drew masked or invalid tokens (row, token) {invalid[:6]}; a masked row's -inf must stay "
            "excluded (subtracting a row's mean or max turns -inf into NaN)"
        )
        if output.logprobs is not None:
            assert not torch.isnan(output.logprobs).any(), f"{label}: logprobs contain NaN"


SEEDED_STREAM_STEPS = 400


def check_seeded_streams_advance(sampler: Sampler, *, device: str = "cpu") -> None:
    """Successive steps of one seeded request draw from its one generator, which advances: over
    :data:`SEEDED_STREAM_STEPS` steps its tokens follow the row's distribution (chi-square), as a stream must."""
    import torch

    row = RowParams(temperature=1.0, seed=11)
    vocab = len(FREQUENCY_LOGITS)
    logits = torch.tensor([FREQUENCY_LOGITS], dtype=torch.float32, device=device)
    metadata = build_metadata([row], vocab, device=device)
    with fixed_default_seed():
        tokens = [sample_tokens(sampler, logits, metadata)[0] for _ in range(SEEDED_STREAM_STEPS)]
    counts = [tokens.count(token) for token in range(vocab)]
    assert len(set(tokens)) > 1, (
        f"seed 11: {SEEDED_STREAM_STEPS} successive steps of one seeded request all drew token {tokens[0]}: its "
        "generator does not advance between steps (restarted, re-seeded or copied each step)"
    )
    try:
        assert_distribution(tokens, reference_probs(FREQUENCY_LOGITS, row), "seed 11, successive steps")
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}; counts {counts}: a seeded request's generator must advance from step to step"
        ) from None


# -- role "sample": seeds -----------------------------------------------------------------------------------


def check_seeded_rows(sampler: Sampler, *, steps: int = 3, device: str = "cpu") -> None:
    """A seeded row gives the same tokens alone and among 31 other rows, shuffled differently at every step."""
    import torch

    vocab = 1000
    logits = _noise((32, vocab)) * 1.5
    targets = [RowParams(temperature=t, seed=s) for t, s in [(1.0, 11), (0.8, 22), (1.2, 33), (1.0, 44)]]
    others = [
        RowParams(temperature=0.0)
        if i % 3 == 0
        else RowParams(temperature=0.7 + 0.1 * (i % 5), seed=1000 + i if i % 3 == 1 else None)
        for i in range(28)
    ]
    rows = targets + others

    alone = []
    with fixed_default_seed(1):
        for index, row in enumerate(targets):
            metadata = build_metadata([row], vocab, device=device)
            alone.append(
                [sample_tokens(sampler, logits[index : index + 1].to(device), metadata)[0] for _ in range(steps)]
            )

    in_batch: list[list[int]] = [[] for _ in targets]
    generators = {index: _generator(row.seed, device) for index, row in enumerate(rows) if row.seed is not None}
    shuffle = torch.Generator().manual_seed(SEED)
    with fixed_default_seed(2):
        for _ in range(steps):
            order = torch.randperm(len(rows), generator=shuffle).tolist()
            metadata = build_metadata([replace(rows[i], seed=None) for i in order], vocab, device=device)
            metadata.generators = {position: generators[i] for position, i in enumerate(order) if i in generators}
            tokens = sample_tokens(sampler, logits[order].to(device), metadata)
            for position, i in enumerate(order):
                if i < len(targets):
                    in_batch[i].append(tokens[position])
    for index, row in enumerate(targets):
        assert alone[index] == in_batch[index], (
            f"seed {row.seed}: tokens {alone[index]} alone but {in_batch[index]} in a shuffled batch of 32"
        )
    assert len({tuple(tokens) for tokens in alone}) > 1, f"different seeds gave the same tokens {alone}"


# -- role "sample": logits processors, checked through the greedy choice ------------------------------------

A, B, C = 2, 5, 6
"""Token ids of the processor cases: A leads B, and the parameter under test may flip the choice."""


def _two_way(a: float, b: float, vocab: int = 8, low: float = -10.0) -> list[float]:
    row = [low] * vocab
    row[A], row[B] = a, b
    return row


PROCESSOR_CASES: dict[str, list[tuple[list[float], RowParams, int]]] = {
    # (logits, row, expected greedy token); each pair of rows sits just either side of the flip point.
    "repetition_penalty": [
        (_two_way(2.0, 1.5), RowParams(output=(A,), repetition_penalty=1.3), A),  # 2 / 1.3 = 1.54 > 1.5
        (_two_way(2.0, 1.5), RowParams(output=(A,), repetition_penalty=1.37), B),  # 2 / 1.37 = 1.46
        (_two_way(2.0, 1.5), RowParams(output=(A, A, A), repetition_penalty=1.3), A),  # once, not per occurrence
        (_two_way(2.0, 1.5), RowParams(prompt=(A,), repetition_penalty=1.37), B),  # the prompt counts
        (_two_way(-1.0, -1.2), RowParams(output=(A,), repetition_penalty=1.15), A),  # -1.15 > -1.2
        (_two_way(-1.0, -1.2), RowParams(output=(A,), repetition_penalty=1.25), B),  # negative: multiplied
        (_two_way(2.0, 1.5), RowParams(output=(B,), repetition_penalty=1.37), A),  # only seen tokens change
    ],
    "frequency_penalty": [
        (_two_way(2.0, 1.5), RowParams(output=(A, A, A), frequency_penalty=0.15), A),  # 2 - 3 * .15 = 1.55
        (_two_way(2.0, 1.5), RowParams(output=(A, A, A), frequency_penalty=0.18), B),  # 2 - 3 * .18 = 1.46
        (_two_way(2.0, 1.5), RowParams(output=(A,), frequency_penalty=0.45), A),  # 2 - .45 = 1.55
        (_two_way(2.0, 1.5), RowParams(prompt=(A,), frequency_penalty=2.0), A),  # the prompt does not count
        (_two_way(2.0, 1.5), RowParams(output=(B, B), frequency_penalty=-0.3), B),  # negative: 1.5 + .6
    ],
    "presence_penalty": [
        (_two_way(2.0, 1.5), RowParams(output=(A, A, A), presence_penalty=0.45), A),  # once, not per occurrence
        (_two_way(2.0, 1.5), RowParams(output=(A,), presence_penalty=0.55), B),
        (_two_way(2.0, 1.5), RowParams(prompt=(A,), presence_penalty=2.0), A),  # the prompt does not count
    ],
    "logit_bias": [
        (_two_way(2.0, 1.5), RowParams(logit_bias={B: 0.45}), A),
        (_two_way(2.0, 1.5), RowParams(logit_bias={B: 0.55}), B),
        (_two_way(2.0, 1.5), RowParams(logit_bias={A: -0.55}), B),
        (_two_way(2.0, 1.5), RowParams(logit_bias={B: 0.3, C: 12.2}), C),
        (_two_way(2.0, 1.5), RowParams(), A),
    ],
    "min_tokens": [
        # Token A is the stop token and the best; B the next best.
        (_two_way(3.0, 2.0), RowParams(output=(1, 3), min_tokens=(3, frozenset({A}))), B),
        (_two_way(3.0, 2.0), RowParams(output=(1, 3, 4), min_tokens=(3, frozenset({A}))), A),
        (_two_way(3.0, 2.0, low=1.0), RowParams(min_tokens=(5, frozenset({A, B}))), 0),
        (_two_way(3.0, 2.0), RowParams(output=(1,)), A),
    ],
    "allowed_token_ids": [
        (_two_way(3.0, 2.0), RowParams(allowed_token_ids=(B, 7)), B),
        (_two_way(3.0, 2.0), RowParams(allowed_token_ids=(0, 7)), 0),
        (_two_way(3.0, 2.0), RowParams(), A),
    ],
    "bad_words": [
        (_two_way(3.0, 2.0), RowParams(bad_words=((A,),)), B),
        (_two_way(3.0, 2.0), RowParams(output=(1, 4), bad_words=((4, A),)), B),
        (_two_way(3.0, 2.0), RowParams(output=(4, 1), bad_words=((4, A),)), A),  # must end with the prefix
        (_two_way(3.0, 2.0), RowParams(output=(3, 4), bad_words=((3, 4, A),)), B),
        (_two_way(3.0, 2.0), RowParams(output=(3, 1, 4), bad_words=((3, 4, A),)), A),
        (_two_way(3.0, 2.0), RowParams(output=(4,), bad_words=((3, 4, A),)), A),  # shorter than the prefix
        (_two_way(3.0, 2.0, low=1.0), RowParams(bad_words=((A,), (B,))), 0),
    ],
}


def check_processor(sampler: Sampler, param: str, *, logprobs_mode: str | None = None, device: str = "cpu") -> None:
    """Greedy rows of :data:`PROCESSOR_CASES` pick the documented token; in ``processed`` mode, also check logprobs."""
    cases = PROCESSOR_CASES[param]
    vocab = len(cases[0][0])
    rows = [row for _, row, _ in cases]
    num_logprobs = vocab if logprobs_mode == "processed" else None
    metadata = build_metadata(rows, vocab, device=device, max_num_logprobs=num_logprobs)
    logits = _logits([case_logits for case_logits, _, _ in cases], device)
    with fixed_default_seed():
        output = sampler.sample(logits, metadata)
    tokens = output.sampled_token_ids[:, 0].tolist()
    for index, (case_logits, row, expected) in enumerate(cases):
        assert reference_probs(case_logits, row)[expected] == 1.0, f"bad case {index} for {param}"
        assert tokens[index] == expected, (
            f"{param}: case {index} ({_describe(row)}) chose token {tokens[index]}, expected {expected}; "
            f"logits {case_logits}"
        )
    if num_logprobs is not None:
        expected_logprobs = [_log(_softmax(reference_logits(case_logits, row))) for case_logits, row, _ in cases]
        _assert_logprobs(output, expected_logprobs, num_logprobs, label=param)


def _describe(row: RowParams) -> str:
    neutral = RowParams()
    return ", ".join(
        f"{name}={getattr(row, name)}"
        for name in row.__dataclass_fields__
        if getattr(row, name) != getattr(neutral, name)
    )


def check_min_tokens_random(sampler: Sampler, *, device: str = "cpu") -> None:
    """Random rows never draw a blocked stop token, however likely (400 rows, stop token logit 8, others ~0)."""
    logits = _noise((400, 8)).abs()
    logits[:, A] = 8.0
    rows = [RowParams(temperature=1.0, min_tokens=(2, frozenset({A})))] * 400
    with fixed_default_seed():
        tokens = sample_tokens(sampler, logits.to(device), build_metadata(rows, 8, device=device))
    assert A not in tokens, f"min_tokens: a random row drew the blocked stop token {A}"


def check_allowed_tokens_random(sampler: Sampler, *, device: str = "cpu") -> None:
    """Random rows draw only allowed tokens, and each of them (400 rows, 3 equally likely tokens)."""
    allowed = (0, 4, 6)
    logits = _noise((400, 8)) * 0.1
    logits[:, 7] = 6.0
    rows = [RowParams(temperature=1.0, allowed_token_ids=allowed)] * 400
    with fixed_default_seed():
        tokens = sample_tokens(sampler, logits.to(device), build_metadata(rows, 8, device=device))
    assert set(tokens) == set(allowed), f"allowed_token_ids {allowed}: drew {sorted(set(tokens))}"


# -- role "sample": logprobs --------------------------------------------------------------------------------


def check_logprobs(sampler: Sampler, *, logprobs_mode: str, random_rows: bool = True, device: str = "cpu") -> None:
    """Shapes, values (of ``logprobs_mode``) and ranks of the returned logprobs, on logits full of ties.

    Logits are multiples of 0.5, so many tokens tie exactly; ranks count the
    tokens with a strictly larger logprob, plus one.
    """
    import torch

    vocab, num_rows = 20, 24
    generator = torch.Generator().manual_seed(SEED)
    logits = torch.randint(-8, 9, (num_rows, vocab), generator=generator).float() / 2
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1  # a tie for the greedy token
    rows = [RowParams(temperature=0.7 if (random_rows and i % 2) else 0.0) for i in range(num_rows)]
    if logprobs_mode == "processed":
        expected = [
            _log(reference_probs(row_logits, row))
            if row.temperature
            else _log(_softmax(reference_logits(row_logits, row)))
            for row_logits, row in zip(logits.tolist(), rows, strict=True)
        ]
    else:
        expected = torch.log_softmax(logits.double(), dim=-1).tolist()
    for num_logprobs in (3, 0):
        with fixed_default_seed():
            output = sampler.sample(
                logits.to(device), build_metadata(rows, vocab, device=device, max_num_logprobs=num_logprobs)
            )
        _assert_logprobs(output, expected, num_logprobs, label=f"{logprobs_mode} logprobs, n={num_logprobs}")
        tokens = output.sampled_token_ids[:, 0].tolist()
        assert tokens[0] in (3, 7), f"greedy row 0 chose {tokens[0]}, not one of its tied best tokens 3 and 7"


def _assert_logprobs(output: SamplerOutput, expected: list[list[float]], num_logprobs: int, *, label: str) -> None:
    import torch

    num_rows = len(expected)
    assert (
        output.logprobs is not None and output.logprob_token_ids is not None and output.sampled_token_ranks is not None
    ), f"{label}: logprobs were asked for but not returned"
    assert tuple(output.logprob_token_ids.shape) == (num_rows, num_logprobs + 1), (
        f"{label}: logprob_token_ids has shape {tuple(output.logprob_token_ids.shape)}, "
        f"expected {(num_rows, num_logprobs + 1)}"
    )
    assert tuple(output.logprobs.shape) == (num_rows, num_logprobs + 1), (
        f"{label}: logprobs has shape {tuple(output.logprobs.shape)}, expected {(num_rows, num_logprobs + 1)}"
    )
    assert output.logprob_token_ids.dtype == torch.int64 and output.logprobs.dtype == torch.float32
    assert tuple(output.sampled_token_ranks.shape) == (num_rows,), f"{label}: ranks must be [num_rows]"
    assert output.sampled_token_ranks.dtype == torch.int64, f"{label}: ranks must be int64"
    ids = output.logprob_token_ids.cpu().tolist()
    values = output.logprobs.cpu().tolist()
    ranks = output.sampled_token_ranks.cpu().tolist()
    sampled = output.sampled_token_ids[:, 0].cpu().tolist()
    for row in range(num_rows):
        want = expected[row]
        assert ids[row][0] == sampled[row], (
            f"{label}: row {row} lists token {ids[row][0]} first, but sampled {sampled[row]}"
        )
        for token, value in zip(ids[row], values[row], strict=True):
            assert _close(value, want[token]), (
                f"{label}: row {row}, token {token}: logprob {value}, expected {want[token]}"
            )
        top = sorted(want, reverse=True)[:num_logprobs]
        assert all(_close(got, wanted) for got, wanted in zip(values[row][1:], top, strict=True)), (
            f"{label}: row {row}: top-{num_logprobs} logprobs {values[row][1:]}, expected {top}"
        )
        rank = 1 + sum(value > want[sampled[row]] for value in want)
        assert ranks[row] == rank, f"{label}: row {row}: rank {ranks[row]}, expected {rank} (1 + strictly better)"


def _close(got: float, want: float, tolerance: float = 1e-4) -> bool:
    if math.isinf(want) or math.isinf(got):
        return got == want
    return abs(got - want) <= tolerance


# -- role "verify" --------------------------------------------------------------------------------------------


@dataclass
class VerifyBatch:
    """The inputs of one :meth:`RejectionSampler.verify` call, built per request."""

    metadata: SpecDecodeMetadata
    draft_probs: torch.Tensor | None
    target_logits: torch.Tensor
    bonus_token_ids: torch.Tensor
    sampling: SamplingMetadata
    drafts: list[list[int]] = field(default_factory=list)

    def run(self, verifier: RejectionSampler) -> torch.Tensor:
        """Call ``verifier.verify`` with these inputs."""
        return verifier.verify(self.metadata, self.draft_probs, self.target_logits, self.bonus_token_ids, self.sampling)


def build_verify_batch(
    drafts: Sequence[Sequence[int]],
    target_logits: Sequence[torch.Tensor],
    bonus: Sequence[int],
    rows: Sequence[RowParams],
    *,
    draft_probs: Sequence[torch.Tensor] | None = None,
    device: str = "cpu",
) -> VerifyBatch:
    """Inputs for requests with ``drafts[r]`` scored by ``target_logits[r]`` (``[len(drafts[r]), vocab]``).

    Each request's step is its drafts plus one bonus position::

        drafts [[4, 5], [7]] -> target_logits_indices [0, 1, 3], bonus_logits_indices [2, 4]
    """
    import torch

    num_draft_tokens = [len(request) for request in drafts]
    vocab = target_logits[0].shape[-1]
    offsets = [0]
    for count in num_draft_tokens:
        offsets.append(offsets[-1] + count + 1)
    metadata = SpecDecodeMetadata(
        draft_token_ids=torch.tensor(
            [token for request in drafts for token in request], dtype=torch.int64, device=device
        ),
        num_draft_tokens=num_draft_tokens,
        cu_num_draft_tokens=torch.tensor(num_draft_tokens, dtype=torch.int64).cumsum(0).to(device),
        target_logits_indices=torch.tensor(
            [offsets[r] + i for r, count in enumerate(num_draft_tokens) for i in range(count)],
            dtype=torch.int64,
            device=device,
        ),
        bonus_logits_indices=torch.tensor(
            [offsets[r] + count for r, count in enumerate(num_draft_tokens)], dtype=torch.int64, device=device
        ),
        logits_indices=torch.arange(offsets[-1], device=device),
    )
    return VerifyBatch(
        metadata=metadata,
        draft_probs=None if draft_probs is None else torch.cat(list(draft_probs)).to(device),
        target_logits=torch.cat([logits.reshape(-1, vocab) for logits in target_logits]).float().to(device),
        bonus_token_ids=torch.tensor(bonus, dtype=torch.int64, device=device).reshape(-1, 1),
        sampling=build_metadata(rows, vocab, device=device),
        drafts=[list(request) for request in drafts],
    )


def _target(argmax: Sequence[int], vocab: int, seed: int) -> torch.Tensor:
    import torch

    logits = torch.rand(len(argmax), vocab, generator=torch.Generator().manual_seed(seed))
    logits[range(len(argmax)), list(argmax)] += 5.0
    return logits


def check_verify_greedy(verifier: RejectionSampler, *, random_rows: bool = True, device: str = "cpu") -> None:
    """Greedy requests accept drafts while they equal the target argmax, then add the argmax or the bonus token."""
    vocab = 10
    # (drafts, target argmax per draft, bonus, expected output before padding)
    greedy = [
        ([4, 5, 6], [4, 5, 6], 9, [4, 5, 6, 9]),  # all accepted, bonus appended
        ([7], [2], 9, [2]),  # first rejected: the target's token
        ([], [], 8, [8]),  # no drafts: the bonus token
        ([1, 8, 9], [1, 3, 9], 7, [1, 3]),  # rejected at 1; the later match does not count
        ([0, 0], [0, 0], 3, [0, 0, 3]),
    ]
    requests: list[tuple[list[int], Any, int, RowParams, list[int] | None]] = [
        (drafts, _target(argmax, vocab, SEED + i), bonus, RowParams(), expected)
        for i, (drafts, argmax, bonus, expected) in enumerate(greedy)
    ]
    if random_rows:
        for position, seed in [(1, 1), (4, 2)]:
            requests.insert(position, ([3, 3], _target([3, 1], vocab, seed), 5, RowParams(temperature=1.0), None))
    batch = build_verify_batch(
        [r[0] for r in requests],
        [r[1] for r in requests],
        [r[2] for r in requests],
        [r[3] for r in requests],
        device=device,
    )
    with fixed_default_seed():
        output = batch.run(verifier)
    _assert_layout(output, batch, verifier, vocab)
    rows = output.cpu().tolist()
    for index, (drafts, _, _, _, expected) in enumerate(requests):
        if expected is not None:
            want = expected + [-1] * (len(rows[index]) - len(expected))
            assert rows[index] == want, (
                f"greedy request {index} with drafts {drafts}: got {rows[index]}, expected {want}"
            )
    parsed = type(verifier).parse_output(output, vocab)
    assert [parsed[i] for i, r in enumerate(requests) if r[4] is not None] == [
        r[4] for r in requests if r[4] is not None
    ], f"parse_output gave {parsed}"


def check_verify_layout(verifier: RejectionSampler, *, random_rows: bool = True, device: str = "cpu") -> None:
    """Random (or greedy) requests of 0 to 4 drafts: each row is accepted drafts, one more token, then -1s."""
    import torch

    vocab = 16
    generator = torch.Generator().manual_seed(SEED)
    counts = [3, 0, 4, 1, 2, 4, 0, 3]
    drafts = [torch.randint(vocab, (count,), generator=generator).tolist() for count in counts]
    targets = [torch.randn(count, vocab, generator=generator) for count in counts]
    probs = [torch.randn(count, vocab, generator=generator).softmax(dim=-1) for count in counts]
    rows = [RowParams(temperature=1.0 if random_rows else 0.0)] * len(counts)
    batch = build_verify_batch(
        drafts, targets, list(range(len(counts))), rows, draft_probs=probs if random_rows else None, device=device
    )
    with fixed_default_seed():
        output = batch.run(verifier)
    _assert_layout(output, batch, verifier, vocab)


def _assert_layout(output: torch.Tensor, batch: VerifyBatch, verifier: RejectionSampler, vocab: int) -> None:
    import torch

    num_reqs = len(batch.drafts)
    width = max(len(drafts) for drafts in batch.drafts) + 1
    assert isinstance(output, torch.Tensor) and output.dtype == torch.int64, "verify() must return an int64 tensor"
    assert tuple(output.shape) == (num_reqs, width), (
        f"verify() returned shape {tuple(output.shape)}, expected [num_reqs, max_drafts + 1] = {[num_reqs, width]}"
    )
    rows = output.cpu().tolist()
    bonus = batch.bonus_token_ids[:, 0].tolist()
    parsed = type(verifier).parse_output(output, vocab)
    for index, (row, drafts) in enumerate(zip(rows, batch.drafts, strict=True)):
        emitted = [token for token in row if token != -1]
        assert row == emitted + [-1] * (width - len(emitted)), f"request {index}: -1 padding must trail: {row}"
        assert 1 <= len(emitted) <= len(drafts) + 1, f"request {index}: emitted {len(emitted)} tokens from {drafts}"
        assert all(0 <= token < vocab for token in emitted), f"request {index}: token outside the vocabulary: {row}"
        accepted = len(emitted) - 1
        assert emitted[:accepted] == drafts[:accepted], (
            f"request {index}: {emitted} does not start with its drafts {drafts}"
        )
        if accepted == len(drafts):
            assert emitted[-1] == bonus[index], (
                f"request {index}: every draft accepted, but {emitted[-1]} is not the bonus token {bonus[index]}"
            )
        assert parsed[index] == emitted, f"parse_output: request {index} gave {parsed[index]}, expected {emitted}"


TARGET_LOGITS = ((1.2, 0.3, 2.0, -0.5, 0.9, 1.6, -1.0, 0.0), (0.1, 1.5, -0.4, 2.2, 0.6, -1.2, 1.0, 0.3))
"""Target logits at draft positions 0 and 1 of every request in the distribution test."""
DRAFT_LOGITS = ((2.0, 1.0, -1.0, 1.5, 0.0, -0.5, 1.2, 0.8), (-0.5, 0.4, 1.8, -1.0, 1.1, 0.9, 0.0, 2.0))
"""The drafter's logits: a distribution far from the target's, so accepting blindly shows."""


@dataclass(frozen=True)
class VerifyCase:
    """One distribution test of a rejection sampler."""

    row: RowParams
    with_draft_probs: bool
    params: frozenset[str] = frozenset()
    num_requests: int = 8000


VERIFY_CASES: dict[str, VerifyCase] = {
    "draft_probs": VerifyCase(RowParams(temperature=0.8), True),
    "no_draft_probs": VerifyCase(RowParams(temperature=0.8), False),
    "draft_probs_top_k": VerifyCase(RowParams(temperature=1.3, top_k=5), True, frozenset({"top_k"})),
}


def check_verify_distribution(
    verifier: RejectionSampler, case: VerifyCase, *, label: str = "", device: str = "cpu"
) -> None:
    """The emitted tokens follow the target distribution, whatever the drafts.

    Every request has two drafts: with draft probabilities, drawn from the
    drafter's distribution; without, fixed tokens (a deterministic drafter,
    ``q`` one-hot).  The first emitted token must follow the processed target
    distribution at position 0; the second, among requests whose first draft
    was accepted, the one at position 1.
    """
    import torch

    vocab = len(TARGET_LOGITS[0])
    count = case.num_requests
    generator = torch.Generator().manual_seed(SEED)
    draft_dists = torch.tensor(DRAFT_LOGITS).softmax(dim=-1)
    if case.with_draft_probs:
        drafts = torch.stack(
            [torch.multinomial(dist, count, replacement=True, generator=generator) for dist in draft_dists], dim=1
        )
        probs = [draft_dists] * count
    else:
        drafts = torch.stack([torch.arange(count) % vocab, (torch.arange(count) * 3 + 1) % vocab], dim=1)
        probs = None
    target = torch.tensor(TARGET_LOGITS)
    batch = build_verify_batch(
        drafts.tolist(), [target] * count, [0] * count, [case.row] * count, draft_probs=probs, device=device
    )
    with fixed_default_seed():
        output = batch.run(verifier).cpu()
    name = label or f"{_describe(case.row)}, draft probs {'given' if case.with_draft_probs else 'None'}"
    assert_distribution(output[:, 0].tolist(), reference_probs(TARGET_LOGITS[0], case.row), f"{name}, first token")
    second = output[:, 1][output[:, 1] != -1].tolist()
    assert len(second) > 200, f"{name}: only {len(second)} of {count} first drafts were accepted"
    assert_distribution(second, reference_probs(TARGET_LOGITS[1], case.row), f"{name}, second token")


def check_verify_seeded(verifier: RejectionSampler, *, device: str = "cpu") -> None:
    """A seeded request's output is the same alone and inside a shuffled batch of 16 requests."""
    import torch

    vocab = 50
    generator = torch.Generator().manual_seed(SEED)
    count = 16
    drafts = [torch.randint(vocab, (3,), generator=generator).tolist() for _ in range(count)]
    targets = [torch.randn(3, vocab, generator=generator) for _ in range(count)]
    # The drafter's distribution is close to the target's, so drafts are often but not always accepted.
    probs = [(target + 0.7 * torch.randn(3, vocab, generator=generator)).softmax(dim=-1) for target in targets]
    rows = [
        RowParams(temperature=1.0, seed=100 + i)
        if i < 4
        else RowParams(temperature=0.0 if i % 3 == 0 else 0.9, seed=200 + i if i % 3 == 1 else None)
        for i in range(count)
    ]

    def run(order: list[int]) -> list[list[int]]:
        batch = build_verify_batch(
            [drafts[i] for i in order],
            [targets[i] for i in order],
            [7] * len(order),
            [rows[i] for i in order],
            draft_probs=[probs[i] for i in order],
            device=device,
        )
        return batch.run(verifier).cpu().tolist()

    with fixed_default_seed(1):
        alone = [run([i])[0] for i in range(4)]
    order = torch.randperm(count, generator=generator).tolist()
    with fixed_default_seed(2):
        shuffled = run(order)
    width = len(shuffled[0])
    for i in range(4):
        in_batch = shuffled[order.index(i)]
        want = alone[i] + [-1] * (width - len(alone[i]))
        assert in_batch == want, f"seeded request {i}: {alone[i]} alone but {in_batch} in a shuffled batch of {count}"


# -- the suite ---------------------------------------------------------------------------------------------------


def require(plugin: SamplerBase, role: str, params: Sequence[str] = (), random: bool = False) -> None:
    """Skip the current test, with the reason, unless ``plugin`` has ``role`` and supports what the test needs."""
    capabilities = type(plugin).capabilities
    name = type(plugin).__name__
    if capabilities.role != role:
        skip_not_declared(f"checks the {role!r} role; {name} is a {capabilities.role!r} sampler")
    missing = sorted(set(params) - capabilities.supported_params)
    if missing:
        skip_not_declared(f"{name} does not declare {', '.join(missing)} in supported_params")
    if random and not capabilities.supports_random:
        skip_not_declared(f"{name} is greedy only (supports_random is False)")


class SamplerSuite(SamplerBaseSuite):
    """The conformance suite of the ``sampler`` kind: ``sample`` and ``verify`` plugins alike.

    Set :attr:`plugin_options` to test the plugin with non-default options,
    and :attr:`logprobs_mode` when those options change the mode the
    capabilities declare.
    """

    device: ClassVar[str] = "cpu"
    """Device the inputs are built on."""
    logprobs_mode: ClassVar[str | None] = None
    """The mode returned logprobs are checked in; ``None``: the capabilities' ``logprobs_mode``."""

    @pytest.fixture
    def sampler(self, available: type[SamplerBase]) -> SamplerBase:
        """An instance of the plugin under test, with :attr:`plugin_options`."""
        try:
            options = available.Options.model_validate(self.given_options() or {})
        except ValidationError as exc:
            # test_options_have_defaults reports the plugin's fault; the numeric tests cannot run without options.
            pytest.skip(
                f"{available.__name__}.Options rejects options {self.given_options()!r}; "
                f"set plugin_options on the suite: {exc}"
            )
        return available(options)

    def _logprobs_mode(self, sampler: SamplerBase) -> str:
        return self.logprobs_mode or type(sampler).capabilities.logprobs_mode

    # -- role "sample" --------------------------------------------------------------------------------

    def test_greedy_rows_take_the_argmax(self, sampler: Sampler) -> None:
        require(sampler, "sample")
        check_greedy_rows(sampler, random_rows=type(sampler).capabilities.supports_random, device=self.device)

    def test_low_temperature_converges_to_greedy(self, sampler: Sampler) -> None:
        require(sampler, "sample", random=True)
        check_low_temperature_is_greedy(sampler, device=self.device)

    def test_top_k_keeps_exactly_the_k_most_likely(self, sampler: Sampler) -> None:
        require(sampler, "sample", ["top_k"], random=True)
        check_support(sampler, "top_k", device=self.device)

    def test_top_p_keeps_the_smallest_set_reaching_p(self, sampler: Sampler) -> None:
        require(sampler, "sample", ["top_p"], random=True)
        check_support(sampler, "top_p", device=self.device)

    def test_min_p_keeps_tokens_above_min_p_times_the_max(self, sampler: Sampler) -> None:
        require(sampler, "sample", ["min_p"], random=True)
        check_support(sampler, "min_p", device=self.device)

    @pytest.mark.parametrize("case", sorted(FREQUENCY_CASES))
    def test_frequencies_match_the_processed_distribution(self, sampler: Sampler, case: str) -> None:
        """Chi-square over 20000 draws (4000 seeded); false-failure rate 1e-4 per case."""
        require(sampler, "sample", sorted(FREQUENCY_CASES[case].params), random=True)
        check_frequencies(sampler, FREQUENCY_CASES[case], label=case, device=self.device)

    def test_seeded_rows_ignore_batch_composition_and_order(self, sampler: Sampler) -> None:
        require(sampler, "sample", ["seed"], random=True)
        check_seeded_rows(sampler, device=self.device)

    def test_seeded_streams_advance_from_step_to_step(self, sampler: Sampler) -> None:
        require(sampler, "sample", ["seed"], random=True)
        check_seeded_streams_advance(sampler, device=self.device)

    def test_masked_rows_never_yield_nan_or_a_masked_token(self, sampler: Sampler) -> None:
        """Grammar bitmasks and allowed_token_ids give the sampler rows of -inf logits."""
        require(sampler, "sample")
        capabilities = type(sampler).capabilities
        check_masked_rows(sampler, random_rows=capabilities.supports_random, device=self.device)
        if "logprobs" in capabilities.supported_params:
            check_masked_rows(sampler, random_rows=capabilities.supports_random, logprobs=True, device=self.device)

    def test_frequencies_hold_when_logprobs_are_requested(self, sampler: Sampler) -> None:
        """Asking for logprobs changes what is returned, never what is drawn (chi-square at temperature 0.6)."""
        require(sampler, "sample", ["logprobs"], random=True)
        case = FREQUENCY_CASES["temperature_0.6"]
        check_frequencies(
            sampler, case, label="temperature 0.6 with logprobs=2", device=self.device, max_num_logprobs=2
        )

    @pytest.mark.parametrize("param", ["repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias"])
    def test_penalties_and_logit_bias_change_logits_as_documented(self, sampler: Sampler, param: str) -> None:
        require(sampler, "sample", [param])
        check_processor(sampler, param, logprobs_mode=self._processed_logprobs(sampler), device=self.device)

    def test_min_tokens_blocks_stop_tokens(self, sampler: Sampler) -> None:
        require(sampler, "sample", ["min_tokens"])
        check_processor(sampler, "min_tokens", logprobs_mode=self._processed_logprobs(sampler), device=self.device)
        if type(sampler).capabilities.supports_random:
            check_min_tokens_random(sampler, device=self.device)

    def test_allowed_token_ids_mask_the_others(self, sampler: Sampler) -> None:
        require(sampler, "sample", ["allowed_token_ids"])
        check_processor(
            sampler, "allowed_token_ids", logprobs_mode=self._processed_logprobs(sampler), device=self.device
        )
        if type(sampler).capabilities.supports_random:
            check_allowed_tokens_random(sampler, device=self.device)

    def test_bad_words_ban_their_last_token(self, sampler: Sampler) -> None:
        require(sampler, "sample", ["bad_words"])
        check_processor(sampler, "bad_words", logprobs_mode=self._processed_logprobs(sampler), device=self.device)

    def test_logprobs_shapes_values_and_ranks(self, sampler: Sampler) -> None:
        require(sampler, "sample", ["logprobs"])
        check_logprobs(
            sampler,
            logprobs_mode=self._logprobs_mode(sampler),
            random_rows=type(sampler).capabilities.supports_random,
            device=self.device,
        )

    def _processed_logprobs(self, sampler: SamplerBase) -> str | None:
        # Processed logprobs expose the processed logits, so the processor tests check them exactly too.
        supported = "logprobs" in type(sampler).capabilities.supported_params
        return "processed" if supported and self._logprobs_mode(sampler) == "processed" else None

    # -- role "verify" --------------------------------------------------------------------------------

    def test_verify_greedy_is_exact(self, sampler: RejectionSampler) -> None:
        require(sampler, "verify")
        check_verify_greedy(sampler, random_rows=type(sampler).capabilities.supports_random, device=self.device)

    def test_verify_output_is_padded_and_parses(self, sampler: RejectionSampler) -> None:
        require(sampler, "verify")
        check_verify_layout(sampler, random_rows=type(sampler).capabilities.supports_random, device=self.device)

    @pytest.mark.parametrize("case", sorted(VERIFY_CASES))
    def test_verify_preserves_the_target_distribution(self, sampler: RejectionSampler, case: str) -> None:
        """Chi-square over 8000 requests, first and second token; false-failure rate 2e-4 per case."""
        require(sampler, "verify", sorted(VERIFY_CASES[case].params), random=True)
        check_verify_distribution(sampler, VERIFY_CASES[case], label=case, device=self.device)

    def test_verify_seeded_requests_ignore_batch_composition(self, sampler: RejectionSampler) -> None:
        require(sampler, "verify", ["seed"], random=True)
        check_verify_seeded(sampler, device=self.device)
