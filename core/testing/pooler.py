"""Conformance suite for poolers: what each task's vector means, batches of mixed lengths, and a run of the engine.

A pooler author's test file::

    from patchbay.testing import PoolerSuite

    class TestMyPooler(PoolerSuite):
        plugin_name = "my_pooler"

For every task the pooler declares, the suite pools random hidden states of requests of mixed lengths (the
rows its ``positions`` names, as the runner hands them) and checks:

- one float32 vector per request, of the task's size, finite;
- a request pools alike alone and inside a batch of others (no pooler mixes requests);
- ``embed``: ``normalize`` gives unit vectors, and ``dimensions=d`` keeps the first ``d`` features *before*
  normalizing (``l2(e[:d])``);
- ``classify`` and ``score``: ``activation`` gives the softmax (sigmoid for one label) of what the pooler
  returns without it;

then it runs the pooler in the engine on a tiny random Llama (a ``ForSequenceClassification`` one for the head
tasks), prompts of mixed lengths prefilled in chunks, and compares each vector with the pooler applied to
transformers' own hidden states of that prompt alone.

Options for ``patchbay check`` come from ``PATCHBAY_TEST_POOLER_OPTIONS`` (JSON).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from patchbay.contract.registry import Registry
from patchbay.interfaces import (
    POOLING_TASKS,
    Capabilities,
    ClassificationHead,
    Pooler,
    PoolerCapabilities,
    PoolerConfig,
    PoolingBatch,
    PoolingParams,
    Positions,
    ServingConfig,
)
from patchbay.testing.suite import PluginSuite, _replace

OPTIONS_ENV = "PATCHBAY_TEST_POOLER_OPTIONS"
HIDDEN_SIZE = 32
NUM_LABELS = 3
PROMPT_LENGTHS = (5, 1, 17, 3, 9)
"""Requests of the mixed batches: a single token, under and over a 16-token block."""
SEED = 20241206


def labels_of(task: str) -> int | None:
    """The classification head's outputs the suite gives a pooler of ``task`` (``None``: no head)."""
    return {"embed": None, "classify": NUM_LABELS, "score": 1}[task]


def positions_rows(hidden: Any, positions: Positions) -> Any:
    """The rows of one prompt's hidden states ``[tokens, hidden]`` a pooler reading ``positions`` is handed."""
    if positions == "first":
        return hidden[:1]
    if positions == "last":
        return hidden[-1:]
    return hidden


def pooling_batch(
    pooler: Pooler,
    hidden_states: Sequence[Any],
    params: Sequence[PoolingParams] | None = None,
    head: ClassificationHead | None = None,
) -> PoolingBatch:
    """A batch of prompts with these hidden states (``[tokens, hidden]`` each), as the runner builds it."""
    import torch

    rows = [positions_rows(hidden, pooler.positions) for hidden in hidden_states]
    starts = [0]
    for part in rows:
        starts.append(starts[-1] + part.shape[0])
    return PoolingBatch(
        req_ids=[f"request-{index}" for index in range(len(rows))],
        hidden_states=torch.cat(rows),
        row_starts=starts,
        prompt_lens=[hidden.shape[0] for hidden in hidden_states],
        params=list(params) if params is not None else [PoolingParams()] * len(rows),
        head=head,
    )


class PoolerBaseSuite(PluginSuite[PoolerCapabilities]):
    kind: ClassVar[str] = "pooler"
    capabilities_class: ClassVar[type[Capabilities]] = PoolerCapabilities

    def supported_config(self, capabilities: PoolerCapabilities) -> PoolerConfig:
        task = capabilities.tasks[0]
        return PoolerConfig(
            device=capabilities.devices[0],
            dtype=capabilities.dtypes[0],
            task=task,
            hidden_size=HIDDEN_SIZE,
            num_labels=labels_of(task),
        )

    def unsupported_configs(self, capabilities: PoolerCapabilities) -> list[tuple[str, ServingConfig]]:
        found = super().unsupported_configs(capabilities)
        base = self.supported_config(capabilities)
        for task in POOLING_TASKS:
            if task not in capabilities.tasks:
                found.append((f"task {task}", _replace(base, task=task, num_labels=labels_of(task))))
        return found


class PoolerSuite(PoolerBaseSuite):
    """The conformance suite of the ``pooler`` kind."""

    @pytest.fixture
    def options(self) -> dict[str, Any]:
        """The pooler's options: ``PATCHBAY_TEST_POOLER_OPTIONS`` (JSON) if set, else its defaults."""
        return json.loads(os.environ.get(OPTIONS_ENV) or "{}")

    def make(self, plugin_class: type[Pooler], options: dict[str, Any], task: str, causal: bool = True) -> Pooler:
        """The pooler under test, built for ``task`` on a model of the suite's hidden size."""
        config = PoolerConfig(task=task, hidden_size=HIDDEN_SIZE, causal=causal, num_labels=labels_of(task))
        return plugin_class(plugin_class.Options.model_validate(options), config=config)

    def tasks(self, plugin_class: type[Pooler]) -> tuple[str, ...]:
        return self.declared_capabilities(plugin_class).tasks

    # -- on hidden states alone ----------------------------------------------------------------

    def test_positions_are_declared(self, available: type[Pooler], options: dict[str, Any]) -> None:
        for task in self.tasks(available):
            for causal in (True, False):
                positions = self.make(available, options, task, causal).positions
                assert positions in ("all", "first", "last"), f"positions must be all, first or last: {positions!r}"

    def test_one_float32_vector_per_request(self, available: type[Pooler], options: dict[str, Any]) -> None:
        for task in self.tasks(available):
            pooler = self.make(available, options, task)
            hidden, head = random_inputs(task)
            vectors = list(pooler.pool(pooling_batch(pooler, hidden, head=head)))
            assert len(vectors) == len(hidden), f"{task}: {len(vectors)} vectors for {len(hidden)} requests"
            size = {"embed": HIDDEN_SIZE, "classify": NUM_LABELS, "score": 1}[task]
            for index, vector in enumerate(vectors):
                assert vector.dtype.is_floating_point and vector.dtype == _float32(), (
                    f"{task}: request {index}'s vector is {vector.dtype}, not float32"
                )
                assert tuple(vector.shape) == (size,), f"{task}: request {index}'s vector is {tuple(vector.shape)}"
                assert bool(vector.isfinite().all()), f"{task}: request {index}'s vector is not finite"

    def test_a_request_pools_alike_alone_and_in_a_mixed_batch(
        self, available: type[Pooler], options: dict[str, Any]
    ) -> None:
        import torch

        for task in self.tasks(available):
            pooler = self.make(available, options, task)
            hidden, head = random_inputs(task)
            together = list(pooler.pool(pooling_batch(pooler, hidden, head=head)))
            backwards = list(pooler.pool(pooling_batch(pooler, hidden[::-1], head=head)))[::-1]
            for index, rows in enumerate(hidden):
                (alone,) = pooler.pool(pooling_batch(pooler, [rows], head=head))
                for got, how in ((together[index], "in a batch"), (backwards[index], "in a reversed batch")):
                    assert torch.allclose(got, alone, rtol=1e-5, atol=1e-6), (
                        f"{task}: request {index} ({rows.shape[0]} tokens) pooled {how} of {len(hidden)} differs "
                        "from pooled alone: the pooler mixes requests"
                    )

    def test_normalize_gives_unit_vectors(self, available: type[Pooler], options: dict[str, Any]) -> None:
        import torch

        if "embed" not in self.tasks(available):
            from patchbay.testing.suite import skip_not_declared

            skip_not_declared("normalize is a parameter of the embed task, which the pooler does not serve")
        pooler = self.make(available, options, "embed")
        hidden, _ = random_inputs("embed")
        unit = pooler.pool(pooling_batch(pooler, hidden, [PoolingParams(normalize=True)] * len(hidden)))
        raw = pooler.pool(pooling_batch(pooler, hidden, [PoolingParams(normalize=False)] * len(hidden)))
        for index, (normalized, plain) in enumerate(zip(unit, raw, strict=True)):
            norm = float(normalized.norm())
            assert abs(norm - 1.0) < 1e-5, f"normalize=true gave request {index} a vector of norm {norm}, not 1"
            expected = plain / plain.norm()
            assert torch.allclose(normalized, expected, atol=1e-6), (
                f"request {index}: the normalized embedding is not the unnormalized one scaled to norm 1: "
                "normalize must not change the direction"
            )

    def test_dimensions_keep_the_first_features_then_normalize(
        self, available: type[Pooler], options: dict[str, Any]
    ) -> None:
        import torch

        if "embed" not in self.tasks(available):
            from patchbay.testing.suite import skip_not_declared

            skip_not_declared("dimensions is a parameter of the embed task, which the pooler does not serve")
        pooler = self.make(available, options, "embed")
        hidden, _ = random_inputs("embed")
        full = pooler.pool(pooling_batch(pooler, hidden, [PoolingParams(normalize=False)] * len(hidden)))
        for dimensions in (1, 5, HIDDEN_SIZE):
            for normalize in (True, False):
                params = [PoolingParams(dimensions=dimensions, normalize=normalize)] * len(hidden)
                cut = pooler.pool(pooling_batch(pooler, hidden, params))
                for index, (got, whole) in enumerate(zip(cut, full, strict=True)):
                    expected = whole[:dimensions]
                    if normalize:
                        expected = expected / expected.norm()
                    assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-6), (
                        f"request {index}, dimensions={dimensions}, normalize={normalize}: expected the first "
                        f"{dimensions} features of the embedding{', then normalized (l2(e[:d]))' if normalize else ''}"
                        " (Matryoshka: cut before normalizing, never normalize then cut)"
                    )

    def test_activation_gives_the_probabilities_of_the_logits(
        self, available: type[Pooler], options: dict[str, Any]
    ) -> None:
        import torch

        head_tasks = [task for task in self.tasks(available) if task != "embed"]
        if not head_tasks:
            from patchbay.testing.suite import skip_not_declared

            skip_not_declared("activation is a parameter of classify and score, which the pooler does not serve")
        for task in head_tasks:
            pooler = self.make(available, options, task)
            hidden, head = random_inputs(task)
            logits = pooler.pool(pooling_batch(pooler, hidden, [PoolingParams(activation=False)] * len(hidden), head))
            probabilities = pooler.pool(
                pooling_batch(pooler, hidden, [PoolingParams(activation=True)] * len(hidden), head)
            )
            for index, (raw, got) in enumerate(zip(logits, probabilities, strict=True)):
                expected = torch.sigmoid(raw) if raw.shape[0] == 1 else torch.softmax(raw, dim=0)
                assert torch.allclose(got, expected, atol=1e-6), (
                    f"{task}: request {index}'s activation=true values are not the "
                    f"{'sigmoid' if raw.shape[0] == 1 else 'softmax'} of its activation=false logits"
                )
            if task == "classify":
                for index, got in enumerate(probabilities):
                    total = float(got.sum())
                    assert abs(total - 1.0) < 1e-5, f"classify: request {index}'s probabilities add up to {total}"

    # -- in the engine ---------------------------------------------------------------------------

    def test_pools_the_models_own_hidden_states(
        self, available: type[Pooler], options: dict[str, Any], patchbay_registry: Registry
    ) -> None:
        """Through the engine (chunked prefill, mixed lengths): each vector equals the pooler applied to
        transformers' own hidden states of that prompt alone."""
        from patchbay.testing import end_to_end

        reason = end_to_end.unavailable_reason(patchbay_registry)
        if reason:
            pytest.skip(reason)
        for task in self.tasks(available):
            check_engine_against_transformers(available, self.plugin_name, options, task, patchbay_registry)


def _float32() -> Any:
    import torch

    return torch.float32


def random_inputs(task: str, seed: int = SEED) -> tuple[list[Any], ClassificationHead | None]:
    """Hidden states of :data:`PROMPT_LENGTHS` prompts and, for the head tasks, a random head."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(length, HIDDEN_SIZE, generator=generator) for length in PROMPT_LENGTHS]
    labels = labels_of(task)
    if labels is None:
        return hidden, None
    weight = torch.randn(labels, HIDDEN_SIZE, generator=generator) / HIDDEN_SIZE**0.5
    bias = torch.randn(labels, generator=generator)
    return hidden, lambda rows: torch.nn.functional.linear(rows, weight.to(rows.dtype), bias.to(rows.dtype))


ENGINE_LENGTHS = (5, 37, 1, 20, 16, 9)
"""Prompts of the engine run: with a 16-token step budget, the longer ones prefill in several chunks."""
ENGINE_SETTINGS: dict[str, Any] = {
    "scheduler__max_num_batched_tokens": 16,
    "scheduler__chunked_prefill": True,
    "scheduler__max_num_seqs": 4,
    "model__max_model_len": 96,
    "cache__num_blocks": 64,
}


def check_engine_against_transformers(
    pooler_class: type[Pooler], name: str | None, options: dict[str, Any], task: str, registry: Registry | None
) -> None:
    """Run pooler ``name`` (``pooler_class``) for ``task`` in the engine on the kit's tiny model and compare each
    vector with the pooler applied to transformers' own hidden states of that prompt alone."""
    import random

    import torch

    from patchbay.entrypoints.llm import LLM
    from patchbay.testing import end_to_end

    if name is None:
        pytest.skip("the pooler class was supplied directly; the engine finds poolers by registered name")
    model_dir = tiny_pooling_model_dir(task)
    rng = random.Random(SEED)
    prompts = [end_to_end.random_tokens(rng, length) for length in ENGINE_LENGTHS]
    llm = LLM(
        registry=registry,
        model__path=str(model_dir),
        pooling={"name": name, "options": options},
        **{**end_to_end.BASE_SETTINGS, **ENGINE_SETTINGS},
    )
    outputs = llm.pool([list(prompt) for prompt in prompts])
    failed = [(index, output.error) for index, output in enumerate(outputs) if output.error is not None]
    assert not failed, f"{task}: prompts failed in the engine: {failed[:3]}"
    reference, head = transformers_hidden_states(model_dir, prompts)
    pooler = pooler_class(
        pooler_class.Options.model_validate(options),
        config=PoolerConfig(task=task, hidden_size=reference[0].shape[1], num_labels=labels_of(task)),
    )
    for index, (output, hidden) in enumerate(zip(outputs, reference, strict=True)):
        with torch.inference_mode():
            (expected,) = pooler.pool(pooling_batch(pooler, [hidden], head=head))
        got = torch.tensor(output.data)
        cosine = float(torch.nn.functional.cosine_similarity(got, expected, dim=0))
        assert got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (
            f"{task}: prompt {index} ({len(prompts[index])} tokens) pooled in the engine differs from the pooler on "
            f"transformers' own hidden states of the prompt alone (cosine {cosine:.6f})"
        )


def tiny_pooling_model_dir(task: str) -> Path:
    """The kit's tiny Llama for ``task``: the causal LM for ``embed``, a ``LlamaForSequenceClassification`` of
    :func:`labels_of` labels for the head tasks."""
    from patchbay.testing import end_to_end

    labels = labels_of(task)
    if labels is None:
        return end_to_end.tiny_model_dir()
    return _tiny_classifier_dir(labels)


@functools.cache
def _tiny_classifier_dir(num_labels: int) -> Path:
    from patchbay.testing import end_to_end

    def build(directory: Path) -> None:
        import torch
        import transformers

        from patchbay.toolkit.model_files import bundled_gguf, convert_gguf

        tokenizer = transformers.AutoTokenizer.from_pretrained(convert_gguf(bundled_gguf()))
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            initializer_range=0.2,
            num_labels=num_labels,  # type: ignore[call-arg]  # a PretrainedConfig keyword LlamaConfig passes on
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **end_to_end.TINY_MODEL,
        )
        with torch.random.fork_rng():
            torch.manual_seed(1)
            model = transformers.LlamaForSequenceClassification(config)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return end_to_end.cached_model_dir(f"tiny-llama-classifier{num_labels}", end_to_end.TINY_MODEL, build)


def transformers_hidden_states(model_dir: Path, prompts: Sequence[Sequence[int]]) -> tuple[list[Any], Any]:
    """transformers' final hidden states ``[tokens, hidden]`` of each prompt run alone, float32, eager attention;
    and the model's classification head (``None`` for a model without one)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    classifier = any(name.endswith("ForSequenceClassification") for name in config.architectures or [])
    auto = transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModel
    model = auto.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    base = model.base_model
    with torch.inference_mode():
        hidden = [base(input_ids=torch.tensor([list(prompt)])).last_hidden_state[0] for prompt in prompts]
    return hidden, (model.score if classifier else None)
