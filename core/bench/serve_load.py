"""``patchbay bench serve``: load a ``patchbay serve`` server with the bench's requests, and compare with offline.

The throughput workload's requests (token-id prompts, fixed output lengths
with ``ignore_eos``) are sent as streaming completions at each request rate
(Poisson or fixed arrivals, ``inf``: all at once) under a cap on concurrent
requests.  Per rate: throughput, TTFT, inter-token latency and end-to-end
percentiles.  The same requests then run offline through ``patchbay.LLM``
(``patchbay run``'s path) in this process, after the server has stopped, so
the serving overhead is a measured ratio.  The server is a ``patchbay serve``
subprocess on a loopback port (or ``--url``, one already running).  Both
sides run without the prefix cache, since each rate repeats the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, TextIO

from patchbay.bench import workloads as wl
from patchbay.bench.report import append_json_lines


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("serve (patchbay bench serve)")
    group.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[math.inf],
        help="request rates in requests/s, 'inf' for all at once (default: inf)",
    )
    group.add_argument(
        "--arrivals",
        choices=("poisson", "fixed"),
        default="poisson",
        help="gaps between requests: exponential (Poisson process) or equal",
    )
    group.add_argument("--max-concurrency", type=int, default=64, help="most requests in flight from the client")
    group.add_argument("--url", help="an already running server (default: start patchbay serve on a free port)")


@dataclass
class RequestTiming:
    """What the client saw of one streamed request."""

    start: float
    first_chunk: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    end: float | None = None
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_chunk is None else self.first_chunk - self.start

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in pairwise(self.chunk_times)]


def arrival_offsets(count: int, rate: float, arrivals: str, seed: int) -> list[float]:
    """When each request is sent, in seconds from the start: ``rate`` per second, Poisson or evenly spaced."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate) if arrivals == "poisson" else 1.0 / rate
    return offsets


async def run_load(
    url: str,
    model: str | None,
    requests: list[wl.BenchRequest],
    *,
    rate: float,
    arrivals: str,
    max_concurrency: int,
    seed: int,
) -> tuple[list[RequestTiming], float]:
    """Send every request as a streaming completion; the timings and the wall time.

    ``model`` is the served model's name, or ``None`` (a server given by URL) to let the server answer with its own.
    """
    import httpx

    limit = asyncio.Semaphore(max_concurrency)
    offsets = arrival_offsets(len(requests), rate, arrivals, seed)
    timeout = httpx.Timeout(600.0)
    limits = httpx.Limits(max_connections=max_concurrency + 8, max_keepalive_connections=max_concurrency + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        started = time.perf_counter()

        async def one(request: wl.BenchRequest, offset: float) -> RequestTiming:
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            async with limit:
                timing = RequestTiming(time.perf_counter())
                body = {
                    "model": model,
                    "prompt": request.prompt_token_ids,
                    "max_tokens": request.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                try:
                    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                        if response.status_code != 200:
                            timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                            return timing
                        async for line in response.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            now = time.perf_counter()
                            chunk = json.loads(line[len("data: ") :])
                            if chunk.get("choices"):
                                timing.first_chunk = timing.first_chunk or now
                                timing.chunk_times.append(now)
                            if chunk.get("usage"):
                                timing.completion_tokens = chunk["usage"]["completion_tokens"]
                            if "error" in chunk:
                                timing.error = chunk["error"]["message"]
                except httpx.HTTPError as exc:
                    timing.error = f"{type(exc).__name__}: {exc}"
                timing.end = time.perf_counter()
                return timing

        timings = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
        return list(timings), time.perf_counter() - started


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p90 and p99 in milliseconds (``None`` without values)."""
    if not values:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None}
    if len(values) == 1:
        return {key: values[0] * 1e3 for key in ("p50_ms", "p90_ms", "p99_ms")}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_ms": cuts[49] * 1e3, "p90_ms": cuts[89] * 1e3, "p99_ms": cuts[98] * 1e3}


def summarize(
    label: str,
    seconds: float,
    generated: int,
    ttft: list[float],
    itl: list[float],
    e2e: list[float],
    errors: int,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "run": label,
        "seconds": seconds,
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / seconds if seconds else None,
        "errors": errors,
        "ttft": percentiles(ttft),
        "itl": percentiles(itl),
        "e2e": percentiles(e2e),
        **extra,
    }


def served_row(rate: float, timings: list[RequestTiming], seconds: float, arrivals: str) -> dict[str, Any]:
    done = [t for t in timings if t.error is None]
    return summarize(
        f"serve @ {rate:g} req/s",
        seconds,
        sum(t.completion_tokens for t in done),
        [t.ttft for t in done if t.ttft is not None],
        [gap for t in done for gap in t.inter_token_latencies],
        [t.end - t.start for t in done if t.end is not None],
        len(timings) - len(done),
        rate=None if math.isinf(rate) else rate,
        arrivals=arrivals,
        first_error=next((t.error for t in timings if t.error), None),
    )


def warm_up_requests(requests: list[wl.BenchRequest]) -> list[wl.BenchRequest]:
    """A few of the requests, cut short: run untimed first on each side (first-call allocations, kernel choices)."""
    return [wl.BenchRequest(r.prompt_token_ids, 4) for r in requests[:8]]


def offline_row(requests: list[wl.BenchRequest], settings_overrides: list[str]) -> dict[str, Any]:
    """The same requests through ``patchbay.LLM.generate`` (what ``patchbay run`` does), all at once."""
    import patchbay
    from patchbay.contract.settings import load_settings
    from patchbay.sampling_params import SamplingParams

    llm = patchbay.LLM(load_settings(None, overrides=settings_overrides))
    warm_up = warm_up_requests(requests)
    llm.generate([r.prompt_token_ids for r in warm_up], [SamplingParams(max_tokens=r.max_tokens) for r in warm_up])
    started = time.perf_counter()
    outputs = llm.generate(
        [r.prompt_token_ids for r in requests],
        [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in requests],
    )
    seconds = time.perf_counter() - started
    return summarize(
        "offline (patchbay run)",
        seconds,
        sum(len(o.token_ids) for o in outputs),
        [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None],
        [gap for o in outputs for gap in o.metrics.inter_token_latencies if gap > 0],
        [o.metrics.e2e_latency for o in outputs if o.metrics.e2e_latency is not None],
        0,
    )


def in_process_row(
    requests: list[wl.BenchRequest], settings_overrides: list[str], max_concurrency: int
) -> dict[str, Any]:
    """The same requests through ``patchbay.AsyncLLM`` in this process, no HTTP, at most ``max_concurrency`` at once.

    What the server does less the HTTP layer: its ratio to the served figures is the cost of HTTP, JSON and SSE.
    """
    import patchbay
    from patchbay.contract.settings import load_settings
    from patchbay.sampling_params import SamplingParams

    async def run() -> dict[str, Any]:
        llm = patchbay.AsyncLLM(load_settings(None, overrides=settings_overrides))
        limit = asyncio.Semaphore(max_concurrency)

        async def one(request: wl.BenchRequest, ignore_eos: bool = True) -> Any:
            async with limit:
                async for delta in llm.generate(
                    request.prompt_token_ids, SamplingParams(max_tokens=request.max_tokens, ignore_eos=ignore_eos)
                ):
                    if delta.finished:
                        return delta.output

        await asyncio.gather(*(one(r, False) for r in warm_up_requests(requests)))
        started = time.perf_counter()
        outputs = await asyncio.gather(*(one(r) for r in requests))
        seconds = time.perf_counter() - started
        await llm.shutdown()
        return summarize(
            "in-process AsyncLLM",
            seconds,
            sum(len(o.token_ids) for o in outputs),
            [o.metrics.time_to_first_token for o in outputs],
            [gap for o in outputs for gap in o.metrics.inter_token_latencies if gap > 0],
            [o.metrics.e2e_latency for o in outputs],
            0,
        )

    return asyncio.run(run())


@contextlib.contextmanager
def serve_subprocess(overrides: list[str], stream: TextIO) -> Iterator[tuple[str, str]]:
    """``patchbay serve`` on 127.0.0.1 and a free port; yields its URL and model name, stops it with SIGTERM."""
    command = [
        sys.executable,
        "-m",
        "patchbay.entrypoints.cli",
        "serve",
        "/dev/null",
        *(
            arg
            for override in [*overrides, "server.port=0", "server.host=127.0.0.1", "server.served_model_name=bench"]
            for arg in ("--set", override)
        ),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        banner = process.stdout.readline() if process.stdout else ""
        if " on http://" not in banner:
            raise RuntimeError(f"patchbay serve did not start (exit {process.wait()}): {banner!r}")
        print(banner.strip(), file=stream, flush=True)
        yield banner.split(" on ")[1].split("/v1")[0], "bench"
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def print_rows(rows: list[dict[str, Any]], stream: TextIO) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    print(
        f"\n{'run':<26}{'tok/s':>9}{'TTFT p50':>10}{'p90':>8}{'p99':>8}{'ITL p50':>9}{'p90':>8}{'p99':>8}"
        f"{'e2e p50':>9}{'errors':>8}",
        file=stream,
    )
    for row in rows:
        print(
            f"{row['run']:<26}{row['generated_tokens_per_s'] or 0:>9.1f}{ms(row['ttft']['p50_ms']):>10}"
            f"{ms(row['ttft']['p90_ms']):>8}{ms(row['ttft']['p99_ms']):>8}{ms(row['itl']['p50_ms']):>9}"
            f"{ms(row['itl']['p90_ms']):>8}{ms(row['itl']['p99_ms']):>8}{ms(row['e2e']['p50_ms']):>9}"
            f"{row['errors']:>8}",
            file=stream,
        )


def write_latency_plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """TTFT and inter-token latency (p50, p99) against the request rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    served = sorted(
        (row for row in rows if row["run"].startswith("serve") and row.get("rate")), key=lambda row: row["rate"]
    )
    if not served:
        return None
    figure, axis = plt.subplots(figsize=(7, 4.5))
    rates = [row["rate"] for row in served]
    for metric, name in (("ttft", "TTFT"), ("itl", "inter-token")):
        for cut in ("p50_ms", "p99_ms"):
            axis.plot(rates, [row[metric][cut] for row in served], marker="o", label=f"{name} {cut[:3]}")
    axis.set_xlabel("request rate (requests/s)")
    axis.set_ylabel("latency (ms)")
    axis.set_yscale("log")
    axis.set_title("patchbay serve: latency against request rate")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def serve_bench(args: argparse.Namespace, stream: TextIO = sys.stdout) -> int:
    """Entry of ``patchbay bench serve``."""
    from transformers import AutoTokenizer

    from patchbay.toolkit.model_files import resolve_model_dir

    max_num_seqs = max(args.concurrency)
    # No prefix cache: every rate sends the same requests, and a later run must not find an earlier one's prompts.
    overrides = [
        f"model.path={args.model}",
        f"scheduler.max_num_seqs={max_num_seqs}",
        "cache.prefix_caching=false",
        f"scheduler.max_num_batched_tokens={args.max_num_batched_tokens}",
        f"server.max_waiting={max(args.num_requests, args.max_concurrency)}",
    ]
    if args.threads is not None:
        overrides.append(f"runtime.threads={args.threads}")
    model_dir = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = wl.throughput(
        wl.source_corpus(tokenizer),
        num_requests=args.num_requests,
        prompt_range=tuple(args.prompt_range),
        output_range=tuple(args.output_range),
        concurrency=max_num_seqs,
        seed=args.seed,
    )
    rows = []
    server = contextlib.nullcontext((args.url, None)) if args.url else serve_subprocess(overrides, stream)
    with server as (url, model):
        asyncio.run(
            run_load(
                url,
                model,
                warm_up_requests(workload.requests),
                rate=math.inf,
                arrivals="fixed",
                max_concurrency=args.max_concurrency,
                seed=args.seed,
            )
        )
        for rate in args.rates:
            print(
                f"serve: {len(workload.requests)} requests at {rate:g} req/s ({args.arrivals}), "
                f"at most {args.max_concurrency} in flight ...",
                file=stream,
                flush=True,
            )
            timings, seconds = asyncio.run(
                run_load(
                    url,
                    model,
                    workload.requests,
                    rate=rate,
                    arrivals=args.arrivals,
                    max_concurrency=args.max_concurrency,
                    seed=args.seed,
                )
            )
            rows.append(served_row(rate, timings, seconds, args.arrivals))
    print("offline: the same requests through patchbay.LLM ...", file=stream, flush=True)
    offline = offline_row(workload.requests, overrides)
    rows.append(offline)
    print("in process: the same requests through patchbay.AsyncLLM, no HTTP ...", file=stream, flush=True)
    in_process = in_process_row(workload.requests, overrides, args.max_concurrency)
    rows.append(in_process)
    all_at_once = next((row for row in rows if row["run"].startswith("serve") and row.get("rate") is None), None)
    if all_at_once is not None and all_at_once["generated_tokens_per_s"]:
        all_at_once["overhead_x"] = offline["generated_tokens_per_s"] / all_at_once["generated_tokens_per_s"]
        all_at_once["http_overhead_x"] = in_process["generated_tokens_per_s"] / all_at_once["generated_tokens_per_s"]
    print_rows(rows, stream)
    if all_at_once is not None and "overhead_x" in all_at_once:
        print(
            f"\nserving overhead (offline tok/s / served tok/s, all requests at once): "
            f"{all_at_once['overhead_x']:.2f}x; HTTP overhead (in-process AsyncLLM tok/s / served tok/s, same "
            f"concurrency cap): {all_at_once['http_overhead_x']:.2f}x",
            file=stream,
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        append_json_lines(args.out / "serve.jsonl", rows, model=str(model_dir), requests=len(workload.requests))
        plot = write_latency_plot(rows, args.out / "serve.png")
        print(f"wrote {args.out / 'serve.jsonl'}" + (f" and {plot}" if plot else ""), file=stream)
    return 1 if any(row["errors"] for row in rows) else 0
