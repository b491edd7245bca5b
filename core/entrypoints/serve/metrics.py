"""``GET /metrics``: the engine's load, counters and latencies in Prometheus' text format.

Gauges and counters are read at scrape time from the engine's latest
:class:`EngineSnapshot` (taken by the engine thread after each step);
latency histograms are observed as each request finishes.  The same
registry serves vLLM's names (``vllm:*``, :mod:`patchbay.entrypoints.serve.vllm_metrics`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from patchbay.engine import AsyncLLM, RequestOutput
from patchbay.entrypoints.serve.vllm_metrics import VllmMetrics

PREFIX = "patchbay"
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
STEP_PHASE_PLUGIN = {"forward": "attention", "sample": "sampler", "draft": "drafter", "compile": "structured_output"}
"""The plugin kind that does most of a step phase's work (the phase label says which)."""


class EngineCollector(Collector):
    """Gauges and counters from the engine snapshot, computed at scrape time."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        snapshot = self.llm.snapshot
        labels = ["model_name"]
        model = [self.model_name]

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", documentation, labels=labels)
            family.add_metric(model, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{PREFIX}_{name}", documentation, labels=labels)
            family.add_metric(model, value)
            return family

        yield gauge("num_requests_running", "Sequences the scheduler runs now.", snapshot.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting for the scheduler.", snapshot.num_waiting)
        yield gauge("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0 to 1).", snapshot.kv_cache_usage)
        yield gauge(
            "kv_cache_blocks_in_use",
            "KV-cache blocks held by requests.",
            snapshot.num_blocks - 1 - snapshot.num_free_blocks,
        )
        yield gauge("kv_cache_blocks_total", "Allocatable KV-cache blocks.", snapshot.num_blocks - 1)
        yield gauge("engine_alive", "1 while the engine thread runs.", 1.0 if self.llm.alive else 0.0)
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", snapshot.prefix_cache_queries
        )
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", snapshot.prefix_cache_hits)
        yield counter("prompt_tokens", "Prompt tokens of the requests added.", snapshot.num_prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", snapshot.num_generated_tokens)
        yield counter("num_preemptions", "Requests preempted for lack of KV blocks.", snapshot.num_preemptions)
        yield counter("engine_steps", "Engine steps run.", snapshot.num_steps)
        yield counter(
            "spec_decode_num_draft_tokens", "Speculative tokens drafted and verified.", snapshot.num_draft_tokens
        )
        yield counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted.", snapshot.num_accepted_tokens)
        yield counter(
            "kv_connector_loaded_tokens",
            "Prompt tokens a KV connector loaded instead of computing.",
            snapshot.kv_connector_loaded_tokens,
        )
        yield counter(
            "kv_connector_recomputed_blocks",
            "Blocks recomputed after a KV connector failed to load them.",
            snapshot.kv_connector_recomputed_blocks,
        )
        steps = CounterMetricFamily(
            f"{PREFIX}_step_phase_seconds",
            "Seconds spent in each phase of the engine's steps; plugin: the kind doing it.",
            labels=[*labels, "phase", "plugin"],
        )
        for phase, seconds in snapshot.step_timings.items():
            steps.add_metric([*model, phase, STEP_PHASE_PLUGIN.get(phase, "core")], seconds)
        yield steps


class ServerMetrics:
    """The registry ``/metrics`` exposes, with the per-request histograms the server feeds."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(llm, model_name))
        labels = ["model_name"]
        self._model = model_name
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Arrival to first token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Between consecutive tokens.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Arrival to finish.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            f"{PREFIX}_request_success",
            "Requests finished, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            f"{PREFIX}_request_rejected",
            "Requests refused before running, by HTTP status.",
            [*labels, "status"],
            registry=self.registry,
        )
        self.lora_requests = Counter(
            f"{PREFIX}_lora_requests",
            "Finished requests per LoRA adapter.",
            [*labels, "lora_name"],
            registry=self.registry,
        )
        self.lora_generation_tokens = Counter(
            f"{PREFIX}_lora_generation_tokens",
            "Generated tokens per LoRA adapter.",
            [*labels, "lora_name"],
            registry=self.registry,
        )
        llm.add_finish_listener(self.observe)
        self.vllm = VllmMetrics(self.registry, llm, llm.settings, model_name)

    def observe(self, output: RequestOutput) -> None:
        """Record a finished request (called in the engine thread)."""
        metrics = output.metrics
        if metrics.time_to_first_token is not None:
            self.time_to_first_token.labels(self._model).observe(metrics.time_to_first_token)
        if metrics.e2e_latency is not None:
            self.e2e_latency.labels(self._model).observe(metrics.e2e_latency)
        itl = self.inter_token_latency.labels(self._model)
        for gap in metrics.inter_token_latencies:
            if gap > 0:  # tokens of one step (speculative decoding) arrive together
                itl.observe(gap)
        completions = output.completions or [output.completion()]
        for completion in completions:
            self.finished.labels(self._model, str(completion.finish_reason)).inc()
        adapter = output.sampling_params.lora
        if adapter is not None:
            self.lora_requests.labels(self._model, adapter).inc()
            self.lora_generation_tokens.labels(self._model, adapter).inc(sum(len(c.token_ids) for c in completions))
