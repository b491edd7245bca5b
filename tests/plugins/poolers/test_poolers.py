"""The pooler kind: the built-ins and a third party's pass the suite, and the suite catches wrong poolers."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from patchbay.contract.registry import Registry
from patchbay.interfaces import PoolingBatch, PoolingParams
from patchbay.plugins.poolers.classification import ClassifyPooler
from patchbay.plugins.poolers.embedding import LastTokenPooler, MeanPooler
from patchbay.testing import PoolerSuite
from patchbay.testing.pooler import HIDDEN_SIZE, pooling_batch, random_inputs

from repo_paths import REPO_ROOT


class TestMeanConformance(PoolerSuite):
    plugin_name = "mean"


class TestCLSConformance(PoolerSuite):
    plugin_name = "cls"


class TestLastConformance(PoolerSuite):
    plugin_name = "last"


class TestClassifyConformance(PoolerSuite):
    plugin_name = "classify"


class TestScoreConformance(PoolerSuite):
    plugin_name = "score"


@pytest.fixture(scope="module")
def built_ins_and_example() -> Registry:
    """The installed plugins plus the example third-party distribution's hooks, imported from its source tree."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO_ROOT / "tests" / "distributions" / "example_plugin"))
        import patchbay_example.hooks

        registry = Registry.from_entry_points()
        registry.add_plugin(patchbay_example.hooks, name="example")
        yield registry


class TestThirdPartyMaxConformance(PoolerSuite):
    """The example distribution's ``example_max`` pooler (a pooling mode patchbay does not build in)."""

    plugin_name = "example_max"

    @pytest.fixture
    def patchbay_registry(self, built_ins_and_example: Registry) -> Registry:
        return built_ins_and_example


# -- wrong on purpose: each fails the suite's check for its defect, and the failure names it ----------------------


class _MixesRequests(MeanPooler):
    """Wrong on purpose: every request gets the mean of the whole batch's rows."""

    def pool(self, batch: PoolingBatch) -> list[torch.Tensor]:
        whole = batch.hidden_states.float().mean(dim=0)
        return [F.normalize(whole, dim=0) for _ in batch.params]


class _NormalizesThenCuts(MeanPooler):
    """Wrong on purpose: normalizes the whole embedding, then keeps its first features."""

    def pool(self, batch: PoolingBatch) -> list[torch.Tensor]:
        full = super().pool(PoolingBatch(batch.req_ids, batch.hidden_states, batch.row_starts, batch.prompt_lens,
                                         [PoolingParams(normalize=p.normalize) for p in batch.params]))  # fmt: skip
        return [vector[: params.dimensions] if params.dimensions else vector for vector, params in
                zip(full, batch.params, strict=True)]  # fmt: skip


class _NeverNormalizes(LastTokenPooler):
    """Wrong on purpose: ignores ``normalize``."""

    def pool(self, batch: PoolingBatch) -> list[torch.Tensor]:
        return [batch.rows(index)[0].float() for index in range(batch.num_requests)]


class _Float64(MeanPooler):
    """Wrong on purpose: returns float64 vectors."""

    def pool(self, batch: PoolingBatch) -> list[torch.Tensor]:
        return [vector.double() for vector in super().pool(batch)]


class _DropsTheLastRequest(MeanPooler):
    """Wrong on purpose: one vector short."""

    def pool(self, batch: PoolingBatch) -> list[torch.Tensor]:
        return super().pool(batch)[:-1]


class _AlwaysSoftmax(ClassifyPooler):
    """Wrong on purpose: applies the softmax whatever ``activation`` says."""

    def pool(self, batch: PoolingBatch) -> list[torch.Tensor]:
        on = [PoolingParams(activation=True)] * batch.num_requests
        return super().pool(PoolingBatch(batch.req_ids, batch.hidden_states, batch.row_starts, batch.prompt_lens,
                                         on, batch.head))  # fmt: skip


BROKEN: list[tuple[type, str, str]] = [
    (_MixesRequests, "test_a_request_pools_alike_alone_and_in_a_mixed_batch", "mixes requests"),
    (_NormalizesThenCuts, "test_dimensions_keep_the_first_features_then_normalize", "cut before normalizing"),
    (_NeverNormalizes, "test_normalize_gives_unit_vectors", "normalize=true gave request 0 a vector of norm"),
    (_Float64, "test_one_float32_vector_per_request", "not float32"),
    (_DropsTheLastRequest, "test_one_float32_vector_per_request", "4 vectors for 5 requests"),
    (_AlwaysSoftmax, "test_activation_gives_the_probabilities_of_the_logits", "not the softmax"),
]


@pytest.mark.parametrize(("broken", "check", "defect"), BROKEN, ids=[broken.__name__ for broken, _, _ in BROKEN])
def test_the_suite_fails_a_wrong_pooler_naming_the_defect(broken: type, check: str, defect: str):
    with pytest.raises(AssertionError, match=defect):
        getattr(PoolerSuite(), check)(broken, {})


def test_the_built_in_mean_passes_the_checks_the_broken_ones_fail():
    suite = PoolerSuite()
    for _, check, _ in BROKEN:
        getattr(suite, check)(ClassifyPooler if "activation" in check else MeanPooler, {})


class _Example:
    """Direct arithmetic of the built-ins on a batch of known rows."""

    rows: ClassVar[list[torch.Tensor]] = [torch.tensor([[1.0, 2.0], [3.0, 6.0]]), torch.tensor([[-4.0, 0.0]])]


def test_mean_cls_and_last_pool_the_rows_they_name():
    hidden = _Example.rows
    off = [PoolingParams(normalize=False)] * 2
    mean = MeanPooler()
    assert [v.tolist() for v in mean.pool(pooling_batch(mean, hidden, off))] == [[2.0, 4.0], [-4.0, 0.0]]
    last = LastTokenPooler()
    assert [v.tolist() for v in last.pool(pooling_batch(last, hidden, off))] == [[3.0, 6.0], [-4.0, 0.0]]
    (unit, _) = mean.pool(pooling_batch(mean, hidden))
    assert torch.allclose(unit, torch.tensor([2.0, 4.0]) / 20**0.5)


def test_the_head_poolers_read_cls_for_encoders_and_last_for_decoders():
    from patchbay.interfaces import PoolerConfig

    assert ClassifyPooler(config=PoolerConfig(task="classify", causal=False, num_labels=3)).positions == "first"
    assert ClassifyPooler(config=PoolerConfig(task="classify", causal=True, num_labels=3)).positions == "last"
    options = ClassifyPooler.Options(token="mean")
    assert ClassifyPooler(options, config=PoolerConfig(task="classify", num_labels=3)).positions == "all"


def test_a_head_pooler_without_the_models_head_says_so():
    pooler = ClassifyPooler()
    hidden, _ = random_inputs("classify")
    with pytest.raises(ValueError, match="needs the model's classification head"):
        pooler.pool(pooling_batch(pooler, hidden))


def test_score_validates_a_single_label_head():
    from patchbay.interfaces import PoolerConfig
    from patchbay.plugins.poolers.classification import ScorePooler

    assert ScorePooler.validate(PoolerConfig(task="score", hidden_size=HIDDEN_SIZE, num_labels=1)) == []
    assert "one label" in " ".join(ScorePooler.validate(PoolerConfig(task="score", num_labels=3)))
    assert "needs a model with a classification head" in " ".join(
        ScorePooler.validate(PoolerConfig(task="score", num_labels=None))
    )
    assert "task 'embed' not served" in " ".join(ScorePooler.validate(PoolerConfig(task="embed")))


def test_the_guide_example_is_the_example_plugins_pooler():
    """docs/plugin-kinds/pooler.md shows the example distribution's pooler as it is (the suite above passes it)."""
    page = (REPO_ROOT / "docs" / "plugin-kinds" / "pooler.md").read_text()
    mark = "<!-- example: pooler -->\n```python\n"
    example = page[page.index(mark) + len(mark) :].split("```\n", 1)[0]
    source = REPO_ROOT / "tests" / "distributions" / "example_plugin" / "patchbay_example" / "pooler.py"
    assert example == source.read_text(), f"the page's example differs from {source}"
