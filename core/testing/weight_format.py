"""Conformance suite of the ``weight_format`` kind: a format's packed weights against their own float meaning.

A format author's test file::

    from patchbay.testing import WeightFormatSuite

    class TestMyFormat(WeightFormatSuite):
        plugin_name = "my_format"

The suite asks the format to write a checkpoint of a tiny random Llama (its
:meth:`~patchbay.interfaces.WeightFormat.write_checkpoint`), loads it through
the format and checks, for every tensor: it comes once, under the model's
name, with the model's shape; a packed weight's product equals the product by
its own dequantized weight in float64 (within the rounding of the
activations the format declares: int8 per block where
``integer_activations``, else the run's dtype) for one, several and many
rows, with and without a bias; its rows are its dequantized rows; its shards
put back together give the whole product; and the dequantized weights stay
near the float weights they were made from.  In the engine (``patchbay.LLM``
on the checkpoint, the format chosen by name), teacher-forced
log-probabilities equal transformers' on the model holding the format's own
dequantized weights, within that rounding.  A slow check bounds the
perplexity of the bundled model through the format on the held text.

Options for ``patchbay check`` come from ``PATCHBAY_TEST_WEIGHT_FORMAT_OPTIONS`` (JSON).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from patchbay.interfaces import Checkpoint, PackedWeight, WeightFormat, WeightFormatCapabilities
from patchbay.testing.kinds import WeightFormatBaseSuite
from patchbay.testing.suite import skip_not_declared

OPTIONS_ENV = "PATCHBAY_TEST_WEIGHT_FORMAT_OPTIONS"
SEED = 20261207
ROW_COUNTS = (1, 3, 17, 64)
"""Rows of the products checked: a decode, a few requests, a prefill chunk, a large batch."""
PRODUCT_TOLERANCE = {"integer": 3e-2, "float32": 1e-4, "bfloat16": 2e-2}
"""Largest relative error (Frobenius norm of the difference over the oracle's) of a product against the float64
product by the weight's own dequantized values: activations rounded to int8 per block, or to the run's dtype."""
SOURCE_TOLERANCE = 0.6
"""Largest relative error of a dequantized weight against the float weight it was made from: any quantizer of
two bits or more stays well below (4-bit ~0.1, 2-bit ~0.4); a weight of the wrong rows or a zeroed one does not."""
ENGINE_LOGPROB_TOLERANCE = {"integer": 0.05, "float32": 1e-3, "bfloat16": 0.05}
"""Largest mean absolute difference of the prompt tokens' log-probabilities, engine against transformers on the
dequantized weights (the tiny model's are near ``-log(vocabulary)``; a wrong weight moves them by more)."""
ENGINE_PROMPT_TOKENS = 48
PERPLEXITY_INCREASE = 0.25
"""Largest relative increase of the bundled model's perplexity on the held text through the format, over its float
weights (4-bit formats stay within a few per cent)."""


class WeightFormatSuite(WeightFormatBaseSuite):
    """Numeric checks of a weight format against the float meaning of its own packed weights."""

    perplexity_increase: ClassVar[float] = PERPLEXITY_INCREASE
    """The bound of :meth:`test_the_bundled_model_keeps_its_perplexity`: a suite subclass for a format of fewer than
    four bits sets the increase it promises."""

    @pytest.fixture
    def format_options(self) -> dict[str, Any]:
        """The format's options (``PATCHBAY_TEST_WEIGHT_FORMAT_OPTIONS``, JSON; default none)."""
        return json.loads(os.environ.get(OPTIONS_ENV, "{}"))

    @pytest.fixture
    def weight_format(self, available: type[WeightFormat], format_options: dict[str, Any]) -> WeightFormat:
        return available(available.Options.model_validate(format_options))

    @pytest.fixture
    def source(self) -> Path:
        """A float model directory: the conformance kit's tiny random Llama (the bundled tokenizer)."""
        from patchbay.testing.end_to_end import tiny_model_dir

        return tiny_model_dir()

    @pytest.fixture
    def checkpoint(
        self, weight_format: WeightFormat, source: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> Checkpoint:
        """The checkpoint the format writes of :meth:`source` (written once per format and options)."""
        key = _format_key(weight_format, source)
        if key not in _WRITTEN:
            _WRITTEN[key] = weight_format.write_checkpoint(source, tmp_path_factory.mktemp("checkpoint"))
        return _WRITTEN[key]

    # -- helpers -----------------------------------------------------------------------------

    def _capabilities(self, weight_format: WeightFormat) -> WeightFormatCapabilities:
        capabilities = weight_format.capabilities
        assert isinstance(capabilities, WeightFormatCapabilities)
        return capabilities

    def _model_and_slots(self, source: Path) -> tuple[Any, dict[str, Any]]:
        from transformers import AutoConfig

        from patchbay.worker.model.packed_weights import build_empty_model, parameter_slots

        import torch

        model = build_empty_model(AutoConfig.from_pretrained(source), dtype=torch.float32, attn_implementation="eager")
        return model, parameter_slots(model)

    def _load(self, weight_format: WeightFormat, checkpoint: Checkpoint, source: Path, dtype: str) -> dict[str, Any]:
        """Every tensor the format loads (loaded once per format, options and dtype; the tests only read them)."""
        key = (*_format_key(weight_format, source), str(checkpoint.path), dtype)
        if key not in _LOADED:
            _, slots = self._model_and_slots(source)
            _LOADED.clear()  # one format's tensors at a time
            _LOADED[key] = dict(self._tensors(weight_format, checkpoint, slots, dtype))
        return _LOADED[key]

    def _tensors(
        self, weight_format: WeightFormat, checkpoint: Checkpoint, slots: dict[str, Any], dtype: str
    ) -> Iterator[tuple[str, Any]]:
        loaded = weight_format.load(checkpoint, slots, dtype=dtype)
        yield from loaded

    def _packed(self, loaded: dict[str, Any]) -> dict[str, PackedWeight]:
        packed = {name: value for name, value in loaded.items() if isinstance(value, PackedWeight)}
        return packed

    def _dtypes(self, weight_format: WeightFormat) -> list[str]:
        return [dtype for dtype in ("float32", "bfloat16") if dtype in self._capabilities(weight_format).dtypes]

    def _product_tolerance(self, weight_format: WeightFormat, dtype: str) -> float:
        if self._capabilities(weight_format).integer_activations:
            return PRODUCT_TOLERANCE["integer"] + (PRODUCT_TOLERANCE["bfloat16"] if dtype == "bfloat16" else 0.0)
        return PRODUCT_TOLERANCE[dtype]

    # -- loading -------------------------------------------------------------------------------

    def test_it_reads_the_checkpoint_it_wrote(self, weight_format: WeightFormat, checkpoint: Checkpoint) -> None:
        assert weight_format.reads(checkpoint) is None, "the format does not read the checkpoint it wrote"

    def test_it_says_why_it_does_not_read_a_checkpoint(self, weight_format: WeightFormat, tmp_path: Path) -> None:
        stranger = tmp_path / "not-a-model.bin"
        stranger.write_bytes(b"\x00" * 64)
        reason = weight_format.reads(Checkpoint(stranger))
        assert isinstance(reason, str) and reason.strip(), "reads() of a file of zeros must say why it does not read it"

    def test_every_parameter_comes_once_with_the_model_s_shape(
        self, weight_format: WeightFormat, checkpoint: Checkpoint, source: Path
    ) -> None:
        _, slots = self._model_and_slots(source)
        seen: list[str] = []
        for name, value in self._tensors(weight_format, checkpoint, slots, self._dtypes(weight_format)[0]):
            assert name in slots, f"the format gave {name!r}, which the model has no parameter for"
            seen.append(name)
            shape = (value.out_features, value.in_features) if isinstance(value, PackedWeight) else tuple(value.shape)
            assert shape == slots[name].shape, f"{name}: shape {shape}, the model's is {slots[name].shape}"
            if isinstance(value, PackedWeight):
                assert slots[name].role in ("linear", "embedding"), f"{name} ({slots[name].role}) came packed"
                assert value.tensor_type in self._capabilities(weight_format).tensor_types, (
                    f"{name}: tensor type {value.tensor_type!r} is not among the declared tensor_types"
                )
        assert sorted(seen) == sorted(set(seen)), "a parameter came twice"
        assert set(seen) == set(slots), f"missing: {sorted(set(slots) - set(seen))[:5]}"

    def test_the_linear_weights_come_packed(
        self, weight_format: WeightFormat, checkpoint: Checkpoint, source: Path
    ) -> None:
        loaded = self._load(weight_format, checkpoint, source, self._dtypes(weight_format)[0])
        if not self._packed(loaded):
            skip_not_declared("the format re-quantizes after loading: it hands the runner float weights")
        _, slots = self._model_and_slots(source)
        linear = [name for name, slot in slots.items() if slot.role == "linear"]
        packed = [name for name in linear if isinstance(loaded[name], PackedWeight)]
        assert len(packed) >= len(linear) // 2, f"only {len(packed)} of {len(linear)} linear weights came packed"

    # -- packed weights against their own dequantized values -----------------------------------

    def test_products_equal_the_dequantized_weights_product(
        self, weight_format: WeightFormat, checkpoint: Checkpoint, source: Path
    ) -> None:
        import torch

        for dtype in self._dtypes(weight_format):
            loaded = self._load(weight_format, checkpoint, source, dtype)
            packed = self._packed(loaded)
            if not packed:
                skip_not_declared("the format hands the runner float weights")
            tolerance = self._product_tolerance(weight_format, dtype)
            generator = torch.Generator().manual_seed(SEED)
            for name, weight in packed.items():
                dense = weight.dequantize().double()
                assert dense.shape == (weight.out_features, weight.in_features), f"{name}: dequantize() shape"
                for rows in ROW_COUNTS:
                    inputs = torch.randn(rows, weight.in_features, generator=generator, dtype=torch.float64)
                    bias = torch.randn(weight.out_features, generator=generator, dtype=torch.float64)
                    for with_bias in (False, True):
                        expected = inputs @ dense.T + (bias if with_bias else 0)
                        got = weight.product(
                            inputs.to(getattr(torch, dtype)), bias.to(getattr(torch, dtype)) if with_bias else None
                        )
                        assert got.dtype == getattr(torch, dtype), f"{name}: the product is {got.dtype}, not {dtype}"
                        assert got.shape == expected.shape, f"{name}: product shape {tuple(got.shape)}"
                        error = _relative_error(got.double(), expected)
                        assert error <= tolerance, (
                            f"{name} ({weight.tensor_type}, {dtype}, {rows} rows, bias {with_bias}): the product is "
                            f"{error:.2e} away from the dequantized weight's (tolerance {tolerance:.0e})"
                        )
                leading = torch.randn(2, 3, weight.in_features, generator=generator).to(getattr(torch, dtype))
                assert tuple(weight.product(leading, None).shape) == (2, 3, weight.out_features), (
                    f"{name}: the product must keep the inputs' leading dimensions"
                )

    def test_rows_are_the_dequantized_rows(
        self, weight_format: WeightFormat, checkpoint: Checkpoint, source: Path
    ) -> None:
        import torch

        packed = self._packed(self._load(weight_format, checkpoint, source, self._dtypes(weight_format)[0]))
        if not packed:
            skip_not_declared("the format hands the runner float weights")
        for name, weight in packed.items():
            ids = torch.tensor([0, weight.out_features - 1, weight.out_features // 2, 0], dtype=torch.int64)
            assert torch.equal(weight.rows(ids).float(), weight.dequantize()[ids].float()), f"{name}: rows() differ"

    def test_dequantized_weights_stay_near_their_float_source(
        self, weight_format: WeightFormat, checkpoint: Checkpoint, source: Path
    ) -> None:
        from safetensors import safe_open

        packed = self._packed(self._load(weight_format, checkpoint, source, "float32"))
        if not packed:
            skip_not_declared("the format hands the runner float weights")
        with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
            for name, weight in packed.items():
                original = handle.get_tensor(name).double()
                error = _relative_error(weight.dequantize().double(), original)
                assert error <= SOURCE_TOLERANCE, (
                    f"{name} ({weight.tensor_type}): its dequantized values are {error:.2f} away from the float weight "
                    f"they were made from (tolerance {SOURCE_TOLERANCE}): rows out of order, or another tensor's"
                )

    def test_shards_put_back_together_give_the_whole_product(
        self, weight_format: WeightFormat, checkpoint: Checkpoint, source: Path
    ) -> None:
        import torch

        if not self._capabilities(weight_format).shards:
            skip_not_declared("the format declares its weights cannot be cut over ranks")
        packed = self._packed(self._load(weight_format, checkpoint, source, "float32"))
        generator = torch.Generator().manual_seed(SEED)
        for name, weight in packed.items():
            inputs = torch.randn(5, weight.in_features, generator=generator)
            whole = weight.product(inputs, None).double()
            for dim in (0, 1):
                size = weight.out_features if dim == 0 else weight.in_features
                if size % 2:
                    continue
                try:
                    parts = [weight.shard(dim, index, 2) for index in range(2)]
                except ValueError:
                    continue  # a shape the layout cannot cut: the runner checks shapes before it shards
                if dim == 0:
                    joined = torch.cat([part.product(inputs, None) for part in parts], dim=-1).double()
                else:
                    half = weight.in_features // 2
                    joined = torch.stack(
                        [
                            part.product(inputs[:, i * half : (i + 1) * half], None).double()
                            for i, part in enumerate(parts)
                        ]
                    ).sum(dim=0)
                tolerance = self._product_tolerance(weight_format, "float32")
                assert _relative_error(joined, whole) <= tolerance, f"{name}: shards along {dim} do not add up"

    # -- in the engine ----------------------------------------------------------------------------

    def _engine_registry(self, patchbay_registry: Any) -> Any:
        """The installed plugins, with the format under test as ``patchbay_registry`` has it (an in-process
        registry may hold nothing else)."""
        from patchbay import hookimpl
        from patchbay.contract.registry import Registry

        registry = Registry.from_entry_points()
        if self.plugin_name in registry.names(self.kind):
            return registry
        implementation = patchbay_registry.resolve(self.kind, self.plugin_name)
        name = self.plugin_name

        class UnderTest:
            @hookimpl
            def register_weight_formats(self, register: Any) -> None:
                register(name, implementation)

        registry.add_plugin(UnderTest(), name="weight-format-under-test")
        return registry

    def _engine(self, checkpoint: Checkpoint, format_options: dict[str, Any], registry: Any, **settings: Any) -> Any:
        import patchbay

        return patchbay.LLM(
            registry=self._engine_registry(registry),
            model__path=str(checkpoint.path),
            model__weight_format={"name": self.plugin_name, "options": format_options},
            runtime__threads=2,
            **settings,
        )

    def test_the_engine_scores_as_transformers_on_its_dequantized_weights(
        self,
        weight_format: WeightFormat,
        checkpoint: Checkpoint,
        source: Path,
        format_options: dict[str, Any],
        patchbay_registry: Any,
    ) -> None:
        import torch
        from transformers import AutoConfig

        from patchbay.sampling_params import SamplingParams
        from patchbay.worker.model.packed_weights import build_empty_model

        loaded = self._load(weight_format, checkpoint, source, "float32")
        model = build_empty_model(AutoConfig.from_pretrained(source), dtype=torch.float32, attn_implementation="eager")
        plain = {
            name: (value.dequantize() if isinstance(value, PackedWeight) else value).float()
            for name, value in loaded.items()
        }
        model.load_state_dict(plain, strict=False, assign=True)
        model.tie_weights()
        generator = torch.Generator().manual_seed(SEED)
        prompt = torch.randint(0, int(model.config.vocab_size), (ENGINE_PROMPT_TOKENS,), generator=generator).tolist()
        with torch.inference_mode():
            reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
        expected = [float(reference[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        llm = self._engine(checkpoint, format_options, patchbay_registry, model__dtype="float32")
        try:
            (output,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))
        finally:
            llm.engine.close()
        got = [entry.logprobs[0] for entry in (output.prompt_logprobs or [])[1:]]
        assert len(got) == len(expected), "the engine did not score every prompt token"
        difference = sum(abs(a - b) for a, b in zip(got, expected, strict=True)) / len(got)
        kind = "integer" if self._capabilities(weight_format).integer_activations else "float32"
        assert difference <= ENGINE_LOGPROB_TOLERANCE[kind], (
            f"the engine's prompt log-probabilities are {difference:.3g} (mean) away from transformers' on the "
            f"format's own dequantized weights (tolerance {ENGINE_LOGPROB_TOLERANCE[kind]})"
        )

    @pytest.mark.slow
    def test_the_bundled_model_keeps_its_perplexity(
        self, weight_format: WeightFormat, format_options: dict[str, Any], tmp_path: Path, patchbay_registry: Any
    ) -> None:
        import patchbay
        from patchbay.bench import quality
        from patchbay.toolkit.model_files import resolve_model_dir

        float_dir = resolve_model_dir("default")
        target = tmp_path / "bundled"
        target.mkdir()
        checkpoint = weight_format.write_checkpoint(float_dir, target)
        values = []
        for choice in ({"name": "auto"}, {"name": self.plugin_name, "options": format_options}):
            path = float_dir if choice["name"] == "auto" else checkpoint.path
            llm = patchbay.LLM(
                registry=self._engine_registry(patchbay_registry),
                model__path=str(path),
                model__weight_format=choice,
                model__dtype="float32",
                runtime__threads=2,
            )
            try:
                ids = llm.tokenizer.encode(quality.held_text())
                values.append(quality.perplexity(llm, ids, max_windows=4))
            finally:
                llm.engine.close()
        increase = values[1] / values[0] - 1
        assert increase <= self.perplexity_increase, (
            f"the bundled model's perplexity on the held text rose {increase:.1%} through the format "
            f"({values[0]:.2f} -> {values[1]:.2f}; bound {self.perplexity_increase:.0%})"
        )


_WRITTEN: dict[tuple[str, ...], Checkpoint] = {}
_LOADED: dict[tuple[str, ...], dict[str, Any]] = {}


def _format_key(weight_format: WeightFormat, source: Path) -> tuple[str, ...]:
    options = weight_format.options
    dumped = options.model_dump_json() if hasattr(options, "model_dump_json") else repr(options)
    return (type(weight_format).__module__, type(weight_format).__qualname__, dumped, str(source))


def _relative_error(got: Any, expected: Any) -> float:
    difference = float((got - expected).norm())
    scale = float(expected.norm())
    return difference / scale if scale > 0 else difference
