"""The conformance suite of architecture plugins: the real engine on tiny random checkpoints, against transformers.

For every architecture the plugin lists (or the subclass's :attr:`ArchitectureSuite.architectures`), the suite
builds a tiny random checkpoint (:mod:`patchbay.testing.tiny_models`, or the subclass's
:meth:`ArchitectureSuite.tiny_checkpoint`) and checks, in float32 with greedy sampling:

- each prompt alone gives transformers' own ``generate`` tokens (the reference, or the subclass's
  :meth:`ArchitectureSuite.reference_greedy`), and the next token's top log-probabilities are its own;
- the same prompts run together with chunked prefill, prefix-cache hits and preemptions forced by a small pool
  give the same tokens (and the run really had all three);
- where the plugin declares tensor parallelism, two ranks give one rank's tokens;
- every declared attention layer attends exactly once per forward pass, with the shapes its spec declares, and
  what it hands the backend is what the paged cache then holds at the step's slots (a "backdoor" read).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest

from patchbay.contract.registry import Registry
from patchbay.interfaces import (
    ArchitectureCapabilities,
    ArchitectureConfig,
    AttentionImpl,
    AttentionLayerSpec,
    Capabilities,
    Plugin,
    ServingConfig,
)
from patchbay.testing.suite import PluginSuite, _replace, skip_not_declared

PROMPT_LENGTHS = (5, 17, 33, 48, 64, 90, 7)
"""Under a block, several blocks, past every tiny sliding window (20 to 24 tokens)."""
NUM_NEW_TOKENS = 8

TOP_LOGPROBS = 5
LOGPROB_TOLERANCE = 2e-3
"""Float32 arithmetic in another order (fused norms, the backend's attention) moves a log-probability by ~1e-5;
a missing transform of the logits (a soft cap, a scale) by far more."""

SHARED_PREFIX = 40
"""Tokens the changing-batch prompts 1-3 share with prompt 0 (two and a half 16-token blocks)."""

ONE_AT_A_TIME: dict[str, Any] = {
    "scheduler__max_num_seqs": 1,
    "scheduler__max_num_batched_tokens": 512,
    "cache__prefix_caching": False,
}
"""Each prompt alone, prefilled in one step: the run transformers' ``generate`` is compared with."""

CHANGING_BATCH: dict[str, Any] = {
    "scheduler__max_num_seqs": 6,
    "scheduler__max_num_batched_tokens": 32,
    "scheduler__chunked_prefill": True,
    "cache__prefix_caching": True,
    "cache__num_blocks": 10,
    "model__max_model_len": 128,
}
"""Requests join as others finish, prompts prefill in 32-token chunks, later prompts hit earlier ones' prefix blocks,
and 9 usable blocks of 16 tokens force preemptions (six running requests need up to 30, and 18 where a sliding
window of 20 frees the blocks behind it)."""

BASE_SETTINGS: dict[str, Any] = {
    "attention__name": "reference",
    "runtime__threads": 1,
    "runtime__device": "cpu",
    "runtime__linear_kernel": "torch",
    "runtime__fuse_projections": False,
    "model__dtype": "float32",
    "model__max_model_len": 256,
    "cache__block_size": 16,
}
"""Plain torch arithmetic and the reference attention backend: the plugin's model is all that varies."""


class ArchitectureBaseSuite(PluginSuite[ArchitectureCapabilities]):
    """Registration, options and capabilities of an architecture plugin."""

    kind: ClassVar[str] = "architecture"
    capabilities_class: ClassVar[type[Capabilities]] = ArchitectureCapabilities

    def supported_config(self, capabilities: ArchitectureCapabilities) -> ArchitectureConfig:
        architecture = capabilities.architectures[0] if capabilities.architectures else "AnyForCausalLM"
        return ArchitectureConfig(
            device=capabilities.devices[0], dtype=capabilities.dtypes[0], architecture=architecture
        )

    def unsupported_configs(self, capabilities: ArchitectureCapabilities) -> list[tuple[str, ServingConfig]]:
        found = super().unsupported_configs(capabilities)
        base = self.supported_config(capabilities)
        if not capabilities.other_transformers_architectures:
            found.append(("architecture", _replace(base, architecture="NoSuchArchitectureForCausalLM")))
        unsharded = [name for name in capabilities.architectures if name not in capabilities.tensor_parallel]
        if unsharded:
            found.append(("tensor parallelism", _replace(base, architecture=unsharded[0], tensor_parallel_size=2)))
        return found

    def test_capabilities_name_architectures_they_serve(self, plugin_class: type[Plugin]) -> None:
        capabilities = self.declared_capabilities(plugin_class)
        assert capabilities.architectures or capabilities.other_transformers_architectures, (
            "declare the Hugging Face architectures the plugin serves (capabilities.architectures)"
        )
        stray = [name for name in capabilities.tensor_parallel if name not in capabilities.architectures]
        assert not stray, f"tensor_parallel lists architectures the plugin does not list as served: {stray}"


class ArchitectureSuite(ArchitectureBaseSuite):
    """The engine on tiny random checkpoints of every served architecture, against transformers' own tokens.

    Override :meth:`tiny_checkpoint` for an architecture the kit has no tiny config of, and
    :meth:`reference_greedy` for one transformers does not run.
    """

    architectures: ClassVar[tuple[str, ...] | None] = None
    """The architectures the engine checks run on; ``None``: every one the plugin's capabilities list."""

    # -- what a subclass may supply ------------------------------------------------------------

    def tiny_checkpoint(self, architecture: str) -> Path:
        """A tiny random checkpoint of ``architecture`` (the kit's own:
        :func:`patchbay.testing.tiny_models.tiny_checkpoint`, for the architectures of its ``TINY_CONFIGS``)."""
        from patchbay.testing.tiny_models import tiny_checkpoint

        return tiny_checkpoint(architecture)

    def reference_greedy(self, model_dir: Path, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
        """Greedy tokens of each prompt alone, from an implementation the plugin is not (transformers' ``generate``)."""
        from patchbay.testing.tiny_models import transformers_greedy

        return transformers_greedy(model_dir, prompts, num_tokens)

    # -- fixtures ------------------------------------------------------------------------------

    @pytest.fixture
    def checked(self, available: type[Plugin]) -> list[str]:
        """The architectures the engine checks run on: those the kit (or the subclass) can build a checkpoint of.
        Any other listed one skips the test once the rest are checked (unchecked: strict mode fails it)."""
        from patchbay.testing import end_to_end
        from patchbay.testing.tiny_models import TINY_CONFIGS

        capabilities = self.declared_capabilities(available)
        names = list(self.architectures if self.architectures is not None else capabilities.architectures)
        if not names:
            skip_not_declared("the plugin lists no architecture by name, so the kit has no checkpoint to build")
        if not self.plugin_name:
            skip_not_declared("the engine selects the plugin by its registered name; set plugin_name")
        reason = end_to_end.unavailable_reason()
        if reason:
            pytest.skip(reason)
        own_checkpoints = type(self).tiny_checkpoint is not ArchitectureSuite.tiny_checkpoint
        self._unbuilt = [] if own_checkpoints else [name for name in names if name not in TINY_CONFIGS]
        return [name for name in names if name not in self._unbuilt]

    def _skip_unbuilt(self) -> None:
        """Once the test passed for the rest: skip it for the architectures the kit could not build (unchecked:
        strict mode fails it)."""
        unbuilt = getattr(self, "_unbuilt", [])
        if unbuilt:
            pytest.skip(
                f"the kit has no tiny config of {', '.join(unbuilt)} (the others passed); override "
                "tiny_checkpoint() to check it"
            )

    def _run(
        self,
        registry: Registry,
        architecture: str,
        prompts: list[list[int]],
        settings: dict[str, Any],
        params: Any = None,
    ) -> Any:
        from patchbay.entrypoints.llm import LLM
        from patchbay.sampling_params import SamplingParams

        llm = LLM(
            registry=registry,
            model__path=str(self.tiny_checkpoint(architecture)),
            model__architecture__name=self.plugin_name,
            **{**BASE_SETTINGS, **settings},
        )
        params = params or SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True, temperature=0.0)
        outputs = llm.generate([list(prompt) for prompt in prompts], params)
        failed = [(index, output.error) for index, output in enumerate(outputs) if output.finish_reason == "error"]
        if failed:
            raise AssertionError(
                f"{architecture}: "
                + "; ".join(f"prompt {index} failed in the engine: {error}" for index, error in failed)
            )
        return outputs, llm.engine

    def reference_logprobs(self, model_dir: Path, prompts: list[list[int]]) -> list[Any]:
        """Log-probabilities (``[vocab]`` tensors) of the token after each prompt, from an implementation the plugin
        is not (transformers' ``forward``)."""
        from patchbay.testing.tiny_models import transformers_next_logprobs

        return transformers_next_logprobs(model_dir, prompts)

    def _reference(self, architecture: str, prompts: list[list[int]]) -> list[list[int]]:
        return self.reference_greedy(self.tiny_checkpoint(architecture), prompts, NUM_NEW_TOKENS)

    # -- the checks ----------------------------------------------------------------------------

    def test_greedy_tokens_match_the_reference(self, checked: list[str], patchbay_registry: Registry) -> None:
        """Each prompt alone, prefilled in one step, then decoded: transformers' own tokens, for every architecture."""
        for architecture in checked:
            prompts = _prompts(PROMPT_LENGTHS, seed=7)
            expected = self._reference(architecture, prompts)
            outputs, _ = self._run(patchbay_registry, architecture, prompts, ONE_AT_A_TIME)
            _assert_tokens(expected, [o.token_ids for o in outputs], f"{architecture}, each prompt alone")
        self._skip_unbuilt()

    def test_logprobs_match_the_reference(self, checked: list[str], patchbay_registry: Registry) -> None:
        """The next token's top log-probabilities are transformers': whatever the model's forward does to its
        logits after the LM head (soft-capping, scaling) is done here too, so sampling sees the same distribution."""
        for architecture in checked:
            prompts = _prompts((5, 33, 90), seed=13)
            expected = self.reference_logprobs(self.tiny_checkpoint(architecture), prompts)
            from patchbay.sampling_params import SamplingParams

            outputs, _ = self._run(
                patchbay_registry,
                architecture,
                prompts,
                ONE_AT_A_TIME,
                SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0, logprobs=TOP_LOGPROBS),
            )
            for index, (output, reference) in enumerate(zip(outputs, expected, strict=True)):
                top = output.as_dict()["logprobs"][0]
                for token, logprob in zip(top["token_ids"][1:], top["logprobs"][1:], strict=True):
                    want = float(reference[token])
                    assert abs(logprob - want) <= LOGPROB_TOLERANCE, (
                        f"{architecture}: prompt {index}: token {token} has log-probability {logprob:.5f}, "
                        f"transformers' {want:.5f}"
                    )
        self._skip_unbuilt()

    def test_chunked_prefill_prefix_hits_and_preemption_change_nothing(
        self, checked: list[str], patchbay_registry: Registry
    ) -> None:
        """Six requests at a time, prefilled in 32-token chunks, later prompts reusing earlier prompts' cached
        prefix blocks, a pool too small for all of them (preempted requests are recomputed): the tokens of each
        prompt alone."""
        for architecture in checked:
            prompts = _shared_prefix_prompts()
            expected = self._reference(architecture, prompts)
            outputs, engine = self._run(patchbay_registry, architecture, prompts, CHANGING_BATCH)
            if engine.stats.num_preemptions == 0:
                # Every layer has a sliding window, so each request holds only the blocks its window reaches: a
                # pool of what one request may hold at most forces the preemptions.
                most = engine.kv_cache_manager.max_blocks_per_request(
                    CHANGING_BATCH["model__max_model_len"], CHANGING_BATCH["scheduler__max_num_batched_tokens"]
                )
                tight = {**CHANGING_BATCH, "cache__num_blocks": 1 + most}
                outputs, engine = self._run(patchbay_registry, architecture, prompts, tight)
            _assert_tokens(expected, [o.token_ids for o in outputs], f"{architecture}, a changing batch")
            assert engine.stats.num_preemptions > 0, f"{architecture}: the run preempted nothing (the kit's set-up)"
            assert any(o.metrics.num_cached_tokens for o in outputs), (
                f"{architecture}: no prefix hit (the kit's set-up)"
            )
        self._skip_unbuilt()

    def test_tensor_parallel_ranks_give_one_ranks_tokens(
        self, checked: list[str], available: type[Plugin], patchbay_registry: Registry
    ) -> None:
        """Two tensor-parallel ranks give one rank's tokens, for every architecture the plugin declares it shards."""
        capabilities = self.declared_capabilities(available)
        sharded = [name for name in checked if name in capabilities.tensor_parallel]
        if not sharded:
            skip_not_declared("the plugin declares no checked architecture it shards over tensor-parallel ranks")
        prompts = _prompts(PROMPT_LENGTHS[:4], seed=11)
        for architecture in sharded:
            one, _ = self._run(patchbay_registry, architecture, prompts, {})
            two, _ = self._run(patchbay_registry, architecture, prompts, {"runtime__tensor_parallel_size": 2})
            _assert_tokens([o.token_ids for o in one], [o.token_ids for o in two], f"{architecture} over 2 ranks")
        self._skip_unbuilt()

    def test_layers_attend_once_as_declared_and_the_cache_holds_what_they_wrote(
        self, checked: list[str], patchbay_registry: Registry
    ) -> None:
        """Each declared layer calls the backend once per forward pass, with its spec's shapes, and the paged cache
        then holds, at the step's slots, the keys (and values) it handed over: the spec sizes the cache the layers
        really write."""
        for architecture in checked:
            prompts = _prompts((37, 9), seed=3)
            from patchbay.entrypoints.llm import LLM
            from patchbay.sampling_params import SamplingParams

            llm = LLM(
                registry=patchbay_registry,
                model__path=str(self.tiny_checkpoint(architecture)),
                model__architecture__name=self.plugin_name,
                **BASE_SETTINGS,
            )
            engine = llm.engine
            with _recording(engine) as calls:
                llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
            passes = engine.stats.num_steps
            specs = engine.model.layer_specs
            problems = _attention_problems(calls, specs, passes)
            assert not problems, f"{architecture}: " + "; ".join(problems[:4])
        self._skip_unbuilt()


# -- helpers -------------------------------------------------------------------------------------------------------


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    from patchbay.testing.end_to_end import random_tokens

    rng = random.Random(seed)
    return [random_tokens(rng, length) for length in lengths]


def _shared_prefix_prompts() -> list[list[int]]:
    """Seven prompts: 1-3 extend prompt 0's first :data:`SHARED_PREFIX` tokens (prefix hits once it is cached)."""
    from patchbay.testing.end_to_end import random_tokens

    rng = random.Random(5)
    first = random_tokens(rng, 60)
    prefix = first[:SHARED_PREFIX]
    return [
        first,
        prefix + random_tokens(rng, 9),
        prefix + random_tokens(rng, 30),
        prefix + random_tokens(rng, 3),
        random_tokens(rng, 70),
        random_tokens(rng, 21),
        random_tokens(rng, 50),
    ]


def _assert_tokens(expected: list[list[int]], got: list[list[int]], what: str) -> None:
    from patchbay.testing.end_to_end import assert_same_tokens

    assert_same_tokens(expected, got, what)


class _Recorded:
    """One layer's call to its attention implementation: shapes, and whether the cache then held its rows."""

    def __init__(self, layer_idx: int, query: Any, key: Any, value: Any, output: Any, mismatch: str | None) -> None:
        self.layer_idx = layer_idx
        self.shapes = (tuple(query.shape), tuple(key.shape), tuple(value.shape), tuple(output.shape))
        self.num_tokens = int(query.shape[0])
        self.mismatch = mismatch


class _RecordingImpl(AttentionImpl):
    """Wraps one layer's implementation: records each call and reads the cache back at the step's slots."""

    def __init__(self, inner: AttentionImpl, layer_idx: int, backend: Any, calls: list[_Recorded]) -> None:
        self.inner = inner
        self.layer_idx = layer_idx
        self.backend = backend
        self.calls = calls

    def forward(self, query, key, value, kv_cache, metadata):  # noqa: ANN001, ANN201 - the interface's types
        output = self.inner.forward(query, key, value, kv_cache, metadata)
        common = metadata if hasattr(metadata, "slot_mapping") and hasattr(metadata, "query_start_loc") else None
        common = common or getattr(metadata, "common", None)
        mismatch = _cache_mismatch(self.backend, kv_cache, key, value, common) if common is not None else None
        self.calls.append(_Recorded(self.layer_idx, query, key, value, output, mismatch))
        return output


def _cache_mismatch(backend: Any, kv_cache: Any, key: Any, value: Any, common: Any) -> str | None:
    """Why the cache does not hold ``key``/``value`` at the step's slots (``None``: it does)."""
    import torch

    num_tokens = common.num_actual_tokens
    slots = common.slot_mapping[:num_tokens].long()
    if kv_cache.dtype == torch.int8:
        return None  # rounded rows: the kit runs float caches
    if kv_cache.dim() == 4:  # a latent (MLA) cache: one row per token
        held = kv_cache.view(-1, *kv_cache.shape[2:])[slots]
        if not torch.equal(held, key[:num_tokens].to(held.dtype)):
            return "the latent cache does not hold the keys the layer handed over"
        return None
    for name, cache, new in zip(("keys", "values"), backend.split_kv_cache(kv_cache), (key, value), strict=True):
        held = cache.reshape(-1, *cache.shape[2:])[slots]
        if held.shape[1:] != new.shape[1:]:
            return f"its {name} are {tuple(new.shape[1:])} per token, the cache holds {tuple(held.shape[1:])}"
        if not torch.equal(held, new[:num_tokens].to(held.dtype)):
            return f"the cache does not hold the {name} the layer handed over"
    return None


@contextmanager
def _recording(engine: Any) -> Iterator[list[_Recorded]]:
    """Record every attention call of ``engine``'s runner while inside."""
    calls: list[_Recorded] = []
    bindings = engine.runner._bindings
    originals = {index: binding.impl for index, binding in bindings.items()}
    for index, binding in bindings.items():
        binding.impl = _RecordingImpl(binding.impl, index, engine.runner.backend, calls)
    try:
        yield calls
    finally:
        for index, impl in originals.items():
            bindings[index].impl = impl


def _attention_problems(calls: list[_Recorded], specs: dict[int, AttentionLayerSpec], passes: int) -> list[str]:
    """What the recorded calls contradict in the declared specs."""
    problems: list[str] = []
    counts = {index: 0 for index in specs}
    for call in calls:
        counts[call.layer_idx] = counts.get(call.layer_idx, 0) + 1
        spec = specs[call.layer_idx]
        tokens = call.num_tokens
        value_size = spec.value_size if spec.value_size is not None else spec.head_size
        want = (
            (tokens, spec.num_heads, spec.head_size),
            (tokens, spec.num_kv_heads, spec.head_size),
            (tokens, spec.num_kv_heads, value_size),
            (tokens, spec.num_heads, value_size),
        )
        if call.shapes != want:
            problems.append(
                f"layer {call.layer_idx} ({spec.layer_name}) attended with query/key/value/output shapes "
                f"{call.shapes}; its spec declares {want}"
            )
        if call.mismatch:
            problems.append(f"layer {call.layer_idx} ({spec.layer_name}): {call.mismatch}")
    for index, count in counts.items():
        if count != passes:
            name = specs[index].layer_name
            problems.append(f"layer {index} ({name}) attended {count} times in {passes} forward passes (once each)")
    return problems
