"""The runner's pooling state: which hidden-state rows each request keeps across its chunks, by the pooler's
positions, and one pooler call for the requests whose prompt finished in the step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from patchbay.interfaces import Pooler, PoolingBatch, PoolingParams
from patchbay.scheduling.request import PoolingRequest
from patchbay.worker.pooling import StepPooling


class _Recorder(Pooler):
    """Returns each request's rows, flattened, so the test sees exactly what the pooler was handed."""

    def __init__(self, positions: str) -> None:
        super().__init__()
        self.positions = positions  # type: ignore[assignment]
        self.calls: list[PoolingBatch] = []

    def pool(self, batch: PoolingBatch) -> list[torch.Tensor]:
        self.calls.append(batch)
        return [batch.rows(index).flatten() for index in range(batch.num_requests)]


def run_two_steps(positions: str) -> tuple[dict[str, torch.Tensor], _Recorder]:
    """Request ``a`` (5 tokens) in chunks of 3 and 2; request ``b`` (2 tokens) whole in the second step.
    Row ``i`` of a step's hidden states holds the token's position in its prompt, plus 100 for ``b``."""
    recorder = _Recorder(positions)
    pooling = StepPooling(recorder, head=None)
    for req_id in ("a", "b"):
        pooling.add_request(req_id, PoolingRequest(PoolingParams()))
    first = pooling.pool(
        ["a"], np.array([3]), np.array([3]), np.array([0, 3]), np.array([False]), torch.tensor([[0.0], [1.0], [2.0]])
    )
    assert first == {}
    second = pooling.pool(
        ["a", "b"],
        np.array([5, 2]),
        np.array([2, 2]),
        np.array([0, 2, 4]),
        np.array([True, True]),
        torch.tensor([[3.0], [4.0], [100.0], [101.0]]),
    )
    return second, recorder


@pytest.mark.parametrize(
    ("positions", "a", "b"),
    [("all", [0, 1, 2, 3, 4], [100, 101]), ("first", [0], [100]), ("last", [4], [101])],
)
def test_each_request_keeps_the_rows_its_pooler_reads(positions: str, a: list[float], b: list[float]):
    vectors, recorder = run_two_steps(positions)
    assert vectors["a"].tolist() == a and vectors["b"].tolist() == b
    (batch,) = recorder.calls  # one call, for the two requests whose prompt finished
    assert batch.req_ids == ["a", "b"] and batch.prompt_lens == [5, 2]


def test_a_generating_request_is_refused_by_a_pooling_runner():
    with pytest.raises(ValueError, match="generates, but this runner pools"):
        StepPooling(_Recorder("last"), head=None).add_request("g", None)
