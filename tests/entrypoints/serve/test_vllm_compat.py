"""What vLLM's fleet tools read from a worker: the ``vllm:`` metrics (parsed by prometheus_client's own
text parser, as a Prometheus scrape would), the render routes vLLM's router tokenizes through, and the fields
that router adds to every body it forwards (issue 54)."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from repo_paths import REPO_ROOT
from serving import RunningServer, running_server

from patchbay.contract.settings import load_settings

MODEL = "tiny"
PROMPTS = ["The capital of France is", "Once upon a time there was", "1, 2, 3, 4,"]
VLLM_LABELS = {"model_name": MODEL, "engine": "0"}


@pytest.fixture(scope="module")
def server(tiny_llama) -> RunningServer:
    settings = load_settings(
        None,
        overrides=[
            f"model.path={tiny_llama}",
            "cache.num_blocks=128",
            "scheduler.max_num_seqs=8",
            f"server.served_model_name={MODEL}",
        ],
    )
    with running_server(settings) as running:
        yield running


def scrape(server: RunningServer) -> dict[str, dict[tuple, float]]:
    """``/metrics`` through prometheus_client's parser: sample name to {sorted label items: value}."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict[str, dict[tuple, float]], name: str, **labels: str) -> float:
    key = tuple(sorted({**VLLM_LABELS, **labels}.items()))
    assert name in samples, f"{name} is not served"
    assert key in samples[name], f"{name}{labels} not among {list(samples[name])}"
    return samples[name][key]


def test_vllm_metrics_count_what_the_requests_did(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    before = scrape(server)
    completion = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=5, extra_body={"ignore_eos": True})
    server.wait_until_idle()
    after = scrape(server)
    prompt_tokens = completion.usage.prompt_tokens

    def grew(name: str, **labels: str) -> float:
        old = before.get(name, {}).get(tuple(sorted({**VLLM_LABELS, **labels}.items())), 0.0)
        return value(after, name, **labels) - old

    assert grew("vllm:request_success_total", finished_reason="length") == len(PROMPTS)
    assert grew("vllm:prompt_tokens_total") == prompt_tokens
    assert grew("vllm:generation_tokens_total") == 5 * len(PROMPTS)
    assert grew("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert grew("vllm:request_generation_tokens_count") == len(PROMPTS)
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
    ):
        assert grew(f"vllm:{histogram}_count") == len(PROMPTS), histogram
    assert grew("vllm:inter_token_latency_seconds_count") <= 4 * len(PROMPTS)
    # The same numbers as patchbay's own metrics, and the gauges back to idle.
    patchbay_labels = (("model_name", MODEL),)
    assert (
        value(after, "vllm:prefix_cache_queries_total") == after["patchbay_prefix_cache_queries_total"][patchbay_labels]
    )
    assert value(after, "vllm:prefix_cache_hits_total") == after["patchbay_prefix_cache_hits_total"][patchbay_labels]
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0
    info = after["vllm:cache_config_info"]
    [labels] = [dict(key) for key in info]
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == "127" and labels["engine"] == "0"


def test_render_routes_give_the_tokens_tokenize_gives(server):
    rendered = httpx.post(
        f"{server.url}/v1/completions/render", json={"model": MODEL, "prompt": PROMPTS}, timeout=30
    ).json()
    for prompt, item in zip(PROMPTS, rendered, strict=True):
        tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
        assert item["token_ids"] == tokens and item["model"] == MODEL
    messages = [{"role": "user", "content": "What is 12 times 12?"}]
    chat = httpx.post(
        f"{server.url}/v1/chat/completions/render", json={"model": MODEL, "messages": messages}, timeout=30
    ).json()
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    assert chat["token_ids"] == tokens
    unknown = httpx.post(f"{server.url}/v1/completions/render", json={"model": "other", "prompt": "x"}, timeout=30)
    assert unknown.status_code == 404


def test_the_fields_vllms_router_adds_are_accepted_at_their_defaults_only(server):
    added = {"echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True}
    added["return_hidden_states"] = False
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **added}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    refused = httpx.post(f"{server.url}/v1/completions", json={**body, "return_hidden_states": True}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_hidden_states"


def documented_vllm_metrics() -> set[str]:
    """The ``vllm:`` names in the table of docs/fleet.md's metrics section, as exposed (counters with
    ``_total``); the section's prose names some that are not served."""
    text = (REPO_ROOT / "docs" / "fleet.md").read_text()
    section = text.split("## vLLM metrics", 1)[1].split("\n## ", 1)[0]
    rows = "\n".join(line for line in section.splitlines() if line.startswith("| `vllm:"))
    return set(re.findall(r"`(vllm:[a-z0-9_]+)", rows))


def test_the_vllm_metrics_served_are_the_documented_ones(server):
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    served = set()
    for family in text_string_to_metric_families(text):
        # The parser drops a counter's _total from its family name; prometheus_client's _created series (vLLM
        # serves them too) come as families of their own.
        if family.name.startswith("vllm:") and not family.name.endswith("_created"):
            served.add(f"{family.name}_total" if family.type == "counter" else family.name)
    documented = documented_vllm_metrics()
    assert served - documented == set(), "served but not in docs/fleet.md#vllm-metrics"
    assert documented - served == set(), "in docs/fleet.md#vllm-metrics but not served"
