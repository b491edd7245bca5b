"""The ``vllm:`` metrics: what vLLM's routers, production stack, dashboards and autoscalers read, under vLLM's
names, label sets and buckets, served by ``/metrics`` beside patchbay's own ``patchbay_*`` ones.

Every series carries vLLM's labels ``model_name`` (the served model name) and ``engine`` (the replica:
``runtime.data_parallel_rank``).  The names and their meaning follow vLLM's v1 ``PrometheusStatLogger``;
docs/fleet.md#vllm-metrics lists them one to one against patchbay's.  Gauges and counters are read at scrape
time from the engine's snapshot; histograms are observed as each request finishes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from patchbay.contract.settings import Settings
from patchbay.engine import AsyncLLM, RequestOutput

LABELS = ["model_name", "engine"]
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0)
REQUEST_LATENCY_BUCKETS += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75)
TIME_TO_FIRST_TOKEN_BUCKETS += (1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
INTER_TOKEN_LATENCY_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error")
"""vLLM's ``FinishReason`` values that patchbay has (``repetition`` it never reports)."""


def one_two_five_buckets(largest: int) -> list[float]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``largest`` (``100`` -> ``[1, 2, 5, ..., 100]``)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > largest:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class VllmEngineCollector(Collector):
    """vLLM's gauges and counters, from the engine snapshot at scrape time."""

    def __init__(self, llm: AsyncLLM, labels: list[str], cache_info: dict[str, str]) -> None:
        self.llm = llm
        self.labels = labels
        self.cache_info = cache_info

    def collect(self) -> Iterator[Any]:
        snapshot = self.llm.snapshot

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"vllm:{name}", documentation, labels=LABELS)
            family.add_metric(self.labels, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"vllm:{name}", documentation, labels=LABELS)
            family.add_metric(self.labels, value)
            return family

        yield gauge("num_requests_running", "Number of requests in model execution batches.", snapshot.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", snapshot.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", snapshot.kv_cache_usage)
        yield counter(
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            snapshot.prefix_cache_queries,
        )
        yield counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", snapshot.prefix_cache_hits
        )
        yield counter("num_preemptions", "Cumulative number of preemption from the engine.", snapshot.num_preemptions)
        yield counter("prompt_tokens", "Number of prefill tokens processed.", snapshot.num_prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.", snapshot.num_generated_tokens)
        yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.", snapshot.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.", snapshot.num_accepted_tokens)
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=[*self.cache_info, "engine"]
        )
        info.add_metric([*self.cache_info.values(), self.labels[1]], 1.0)
        yield info


class VllmMetrics:
    """vLLM's per-request histograms and finish counts, observed in the engine thread as requests finish.

    ``registry`` is the one ``/metrics`` serves (patchbay's own metrics are in it too).
    """

    def __init__(self, registry: CollectorRegistry, llm: AsyncLLM, settings: Settings, model_name: str) -> None:
        self.labels = [model_name, str(settings.runtime.data_parallel_rank)]
        cache = settings.cache
        cache_info = {
            "block_size": str(cache.block_size),
            "num_gpu_blocks": str(llm.engine.num_blocks - 1),
            "cache_dtype": cache.dtype,
            "enable_prefix_caching": str(cache.prefix_caching),
        }
        registry.register(VllmEngineCollector(llm, self.labels, cache_info))
        token_buckets = one_two_five_buckets(llm.max_model_len)

        def histogram(name: str, documentation: str, buckets: Any) -> Any:
            return Histogram(f"vllm:{name}", documentation, LABELS, buckets=buckets, registry=registry).labels(
                *self.labels
            )

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TIME_TO_FIRST_TOKEN_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY_BUCKETS
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=registry,
        )
        self.success = {reason: success.labels(*self.labels, reason) for reason in FINISH_REASONS}
        llm.add_finish_listener(self.observe)

    def observe(self, output: RequestOutput) -> None:
        """Record a finished request (called in the engine thread)."""
        metrics = output.metrics
        for histogram, value in (
            (self.time_to_first_token, metrics.time_to_first_token),
            (self.e2e_latency, metrics.e2e_latency),
            (self.queue_time, metrics.queue_time),
            (self.inference_time, metrics.inference_time),
            (self.prefill_time, metrics.prefill_time),
            (self.decode_time, metrics.decode_time),
        ):
            if value is not None:
                histogram.observe(value)
        for gap in metrics.inter_token_latencies:
            if gap > 0:  # tokens of one step (speculative decoding) arrive together
                self.inter_token_latency.observe(gap)
        completions = output.completions or [output.completion()]
        generated = sum(len(completion.token_ids) for completion in completions)
        decode_time = metrics.decode_time
        if decode_time is not None and generated > 1:
            self.time_per_output_token.observe(decode_time / (generated - 1))
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(generated)
        params = output.sampling_params
        self.params_n.observe(params.n)
        if params.max_tokens is not None:
            self.params_max_tokens.observe(params.max_tokens)
        for completion in completions:
            reason = str(completion.finish_reason)
            if reason in self.success:
                self.success[reason].inc()
