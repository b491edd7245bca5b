"""Disaggregated prefill behind vllm-router (issue 54): ``router.prefill_replicas: 1`` makes replica 0 a prefill
replica (its KV connector a producer) and replica 1 a decode replica (a consumer), and the router's
prefill/decode mode sends each request to one, then the other.  The decode replica loads the prompt's blocks
from the shared store instead of computing them, and greedy outputs are one engine's."""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

import openai
import pytest
from fleet import running_fleet

import patchbay
from patchbay.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path(sys.executable).with_name("vllm-router").exists() and shutil.which("vllm-router") is None,
        reason="vllm-router is not installed (pip install 'patchbay[fleet]')",
    ),
]

MODEL = "tiny"
WORDS = "river stone cloud amber field lantern orbit copper meadow signal harbor violet quiet engine".split()


def disaggregated_config(directory: Path, model: Path) -> Path:
    config = directory / "disaggregated.yaml"
    config.write_text(
        f"model: {{path: {model}, dtype: float32}}\n"
        "cache: {num_blocks: 512}\n"
        f"server: {{port: 0, served_model_name: {MODEL}}}\n"
        "runtime: {data_parallel_size: 2}\n"
        "router: {prefill_replicas: 1}\n"
        f"kv_connector: {{name: shared_storage, role: both, options: {{path: {directory / 'store'}}}}}\n"
    )
    return config


def test_a_prefill_replica_hands_its_blocks_to_a_decode_replica(tiny_llama, tmp_path):
    rng = random.Random(54)
    heads = [" ".join(rng.choice(WORDS) for _ in range(100)) for _ in range(2)]
    prompts = [f"{heads[index % 2]} question {index}:" for index in range(6)]
    with running_fleet(disaggregated_config(tmp_path, tiny_llama), []) as fleet:
        client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0, timeout=120)
        texts = [
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0).choices[0].text
            for prompt in prompts
        ]
        prefill, decode = fleet.replica_metrics(0), fleet.replica_metrics(1)

    labels = f'{{model_name="{MODEL}"}}'
    assert prefill[f"patchbay_kv_connector_loaded_tokens_total{labels}"] == 0
    assert decode[f"patchbay_kv_connector_loaded_tokens_total{labels}"] > 0, "the decode replica computed it all"
    for metrics in (prefill, decode):  # each request ran on both: prefilled on one, decoded on the other
        assert metrics[f'patchbay_request_success_total{{finished_reason="length",model_name="{MODEL}"}}'] == 6

    offline = patchbay.LLM(model__path=str(tiny_llama), model__dtype="float32", cache__num_blocks=512)
    outputs = offline.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert texts == [output.text for output in outputs]
