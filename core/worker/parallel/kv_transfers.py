"""A KV connector's transfer reports over several ranks: each rank reports its own, every rank joins them alike.

Each rank's worker side reports, after every step, the requests whose async
saves and loads it finished and the blocks it failed to load.  The ranks
exchange their reports over the run's process group (one all-gather per
step, only when a connector is configured) and each joins them the same
way, so the decisions taken from them cannot differ between ranks:

- a request is finished sending (or receiving) once *every* rank reported
  it, in this step or an earlier one: rank 0 reports ``"a"`` in step 5,
  rank 1 in step 7 -> ``"a"`` is finished in step 7;
- a block failed to load if it failed on *any* rank: rank 0 ``{3}``, rank 1
  ``{3, 8}`` -> ``{3, 8}``, which every rank recomputes, so the all-reduces
  of the steps that recompute them pair up.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class TransferReport:
    """What a worker side reported after one step (or what the ranks' reports add up to)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    def encode(self) -> bytes:
        """The report as JSON bytes (ids sorted, so equal reports encode alike)."""
        return json.dumps(
            [sorted(self.finished_sending), sorted(self.finished_recving), sorted(self.invalid_block_ids)]
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> TransferReport:
        """The report :meth:`encode` wrote."""
        sending, recving, invalid = json.loads(data)
        return cls(set(sending), set(recving), {int(block_id) for block_id in invalid})


class TransferReportJoiner:
    """Joins the reports of ``num_ranks`` ranks, step after step (see the module docstring)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._sending: dict[str, set[int]] = {}
        """Request id -> the ranks that reported its saves finished so far."""
        self._recving: dict[str, set[int]] = {}

    def join(self, reports: Sequence[TransferReport]) -> TransferReport:
        """The requests every rank has now reported, and the blocks any rank failed to load (one report per rank)."""
        if len(reports) != self.num_ranks:
            raise ValueError(f"expected a report from each of {self.num_ranks} ranks, got {len(reports)}")
        return TransferReport(
            self._complete(self._sending, [report.finished_sending for report in reports]),
            self._complete(self._recving, [report.finished_recving for report in reports]),
            set().union(*(report.invalid_block_ids for report in reports)),
        )

    def _complete(self, reported: dict[str, set[int]], by_rank: list[set[str]]) -> set[str]:
        done = set()
        for rank, request_ids in enumerate(by_rank):
            for request_id in request_ids:
                ranks = reported.setdefault(request_id, set())
                ranks.add(rank)
                if len(ranks) == self.num_ranks:
                    done.add(request_id)
        for request_id in done:
            del reported[request_id]
        return done


class GathersBytes(Protocol):
    """What the ranks exchange their reports over (a :class:`~patchbay.worker.parallel.distributed.RankGroup`)."""

    def all_gather_bytes(self, payload: bytes) -> list[bytes]: ...


class RankTransferReports:
    """This rank's end of the exchange: every rank calls :meth:`exchange` after every step, in step order."""

    def __init__(self, group: GathersBytes, num_ranks: int) -> None:
        self._group = group
        self._joiner = TransferReportJoiner(num_ranks)

    def exchange(self, report: TransferReport) -> TransferReport:
        """Every rank's report of this step, joined (the same result on every rank)."""
        payloads = self._group.all_gather_bytes(report.encode())
        return self._joiner.join([TransferReport.decode(payload) for payload in payloads])
