"""How cost grows: the bench's axis tables (model size, context, concurrency) and the neighbour table.

Rows of an axis carry ``axis`` (``model size``, ``context``, ``concurrency``)
and ``axis_point`` (``1b``, ``2048``, ``64``); :func:`axis_table` lays them out
one line per point and patchbay engine, each peer's figures beside patchbay's
with the ratio, the KV-cache memory each engine had (patchbay's pool from
its engine, vLLM's ``VLLM_CPU_KVCACHE_SPACE``) and the most patchbay's requests
held at once, and patchbay's decode steps against the bytes they must read
(:mod:`patchbay.bench.steps`).  Rows of the neighbour run
carry ``neighbour`` (``quiet`` or ``busy``); :func:`neighbour_table` gives each
engine's throughput both ways and the ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

AXES = ("model size", "context", "concurrency")


@dataclass
class PeerFigures:
    engine: str
    tokens_per_s: float
    kv_cache_bytes: int | None
    ratio: float
    """patchbay's tokens/s over this peer's (above 1: patchbay is faster)."""


@dataclass
class AxisLine:
    """One point of an axis for one patchbay engine, with every peer measured at that point."""

    point: str
    engine: str
    tokens_per_s: float
    kv_cache_bytes: int | None
    peers: list[PeerFigures] = field(default_factory=list)
    kv_used_bytes: int | None = None
    """The KV blocks the run's requests held at their peak, in bytes."""
    decode_ms_per_step: float | None = None
    decode_bandwidth_fraction: float | None = None
    """Its decode steps' bytes (weights, and every context token's K and V) at the measured bandwidth, over the
    time they took."""


def axis_table(rows: list[dict[str, Any]], axis: str) -> list[AxisLine]:
    """The lines of ``axis``'s table, points in the order they ran, patchbay engines in their order."""
    ours = [row for row in rows if row.get("axis") == axis]
    lines = []
    for point in dict.fromkeys(str(row["axis_point"]) for row in ours):
        at_point = [row for row in ours if str(row["axis_point"]) == point]
        peers = [row for row in at_point if not row["engine"].startswith("patchbay")]
        for row in at_point:
            if not row["engine"].startswith("patchbay"):
                continue
            speed = row["generated_tokens_per_s"]
            lines.append(
                AxisLine(
                    point,
                    row["engine"],
                    speed,
                    row.get("kv_cache_bytes"),
                    [
                        PeerFigures(
                            peer["engine"],
                            peer["generated_tokens_per_s"],
                            peer.get("kv_cache_bytes"),
                            speed / peer["generated_tokens_per_s"],
                        )
                        for peer in peers
                    ],
                    row.get("kv_used_bytes"),
                    row.get("decode_ms_per_step"),
                    row.get("decode_bandwidth_fraction"),
                )
            )
    return lines


def _bytes(value: int | None) -> str:
    return f"{value / 2**30:.2f} GiB" if value else "-"


def print_axis_tables(rows: list[dict[str, Any]], stream: TextIO) -> None:
    """Each axis that has rows, as a table (``x`` columns: patchbay's tokens/s over the peer's)."""
    for axis in AXES:
        lines = axis_table(rows, axis)
        if not lines:
            continue
        print(
            f"\n{axis} axis (generated tokens/s; KV: the KV-cache memory each engine had, and patchbay's requests "
            "held at their peak; decode: patchbay's decode steps, and the bytes they must read at the measured "
            "bandwidth over their time)",
            file=stream,
        )
        for line in lines:
            cells = [f"{axis} {line.point:<8}", f"{line.engine:<36} {line.tokens_per_s:>9.1f} tok/s"]
            cells.append(f"KV {_bytes(line.kv_cache_bytes)}, used {_bytes(line.kv_used_bytes)}")
            if line.decode_ms_per_step is not None and line.decode_bandwidth_fraction is not None:
                cells.append(
                    f"decode {line.decode_ms_per_step:.1f} ms/step, {100 * line.decode_bandwidth_fraction:.0f}% of "
                    "bandwidth"
                )
            for peer in line.peers:
                cells.append(
                    f"{peer.engine} {peer.tokens_per_s:.1f} tok/s, KV {_bytes(peer.kv_cache_bytes)}, x {peer.ratio:.2f}"
                )
            print(" | ".join(cells), file=stream)


@dataclass
class NeighbourLine:
    engine: str
    quiet_tokens_per_s: float
    busy_tokens_per_s: float

    @property
    def kept(self) -> float:
        """Share of its quiet throughput the engine kept beside the busy neighbour."""
        return self.busy_tokens_per_s / self.quiet_tokens_per_s


def neighbour_table(rows: list[dict[str, Any]]) -> list[NeighbourLine]:
    """One line per engine that ran both quietly and beside the neighbour, in the order they ran."""
    runs: dict[str, dict[str, float]] = {}
    for row in rows:
        if row.get("neighbour") in ("quiet", "busy"):
            runs.setdefault(row["engine"], {})[row["neighbour"]] = row["generated_tokens_per_s"]
    return [
        NeighbourLine(engine, both["quiet"], both["busy"])
        for engine, both in runs.items()
        if "quiet" in both and "busy" in both
    ]


def print_neighbour_table(rows: list[dict[str, Any]], stream: TextIO) -> None:
    lines = neighbour_table(rows)
    if not lines:
        return
    print("\nbusy neighbour (one process at nice 19 spinning on one core): generated tokens/s", file=stream)
    for line in lines:
        print(
            f"{line.engine:<44} quiet {line.quiet_tokens_per_s:>9.1f}  with neighbour {line.busy_tokens_per_s:>9.1f}"
            f"  kept {100 * line.kept:.0f}%",
            file=stream,
        )


def write_axis_plots(rows: list[dict[str, Any]], directory: Path, stream: TextIO) -> list[Path]:
    """``axis-<name>.png`` per axis that has rows: generated tokens/s at each point, one line per engine.
    Without matplotlib (an optional dependency) no plot, and a note saying so."""
    axes = [axis for axis in AXES if any(row.get("axis") == axis for row in rows)]
    if not axes:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no axis plots: matplotlib is not installed (pip install 'patchbay[bench]')", file=stream)
        return []
    written = []
    for axis in axes:
        ours = [row for row in rows if row.get("axis") == axis]
        points = list(dict.fromkeys(str(row["axis_point"]) for row in ours))
        figure, plot = plt.subplots(figsize=(7, 4.5))
        for engine in dict.fromkeys(row["engine"] for row in ours):
            speeds = {str(row["axis_point"]): row["generated_tokens_per_s"] for row in ours if row["engine"] == engine}
            xs = [index for index, point in enumerate(points) if point in speeds]
            plot.plot(xs, [speeds[points[index]] for index in xs], marker="o", label=engine)
        plot.set_xticks(range(len(points)), points)
        plot.set_xlabel(axis)
        plot.set_ylabel("generated tokens/s")
        plot.set_title(f"cost along the {axis} axis")
        plot.legend(fontsize=8)
        figure.tight_layout()
        path = directory / f"axis-{axis.replace(' ', '-')}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written
