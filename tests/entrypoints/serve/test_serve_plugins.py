"""Behind the server, speculative decoding (ngram) and a KV connector (shared_storage) change no output."""

from __future__ import annotations

import asyncio

import openai
import pytest
from serving import running_server

import patchbay
from patchbay import SamplingParams
from patchbay.contract.settings import load_settings

# Longer than a block (16 tokens), so the connector has full blocks to save and load.
PROMPTS = [
    f"{start} and then the story went on for a long while, as stories do."
    for start in ("one two three four", "The cat sat on the mat.", "red green blue", "Once upon a time")
]
ALLOWED_WORDS = " one two three four five six"
"""Outputs limited to these tokens repeat themselves, so the ngram drafter has earlier occurrences to copy
(a random model's free output never recurs)."""


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-store")


def plugin_settings(model_dir, storage):
    return load_settings(
        None,
        overrides=[
            f"model.path={model_dir}",
            "cache.num_blocks=256",
            "scheduler.max_num_seqs=8",
            "spec_decode.name=ngram",
            "spec_decode.num_speculative_tokens=3",
            "kv_connector.name=shared_storage",
            f"kv_connector.options.path={storage}",
        ],
    )


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy outputs of the plain engine: no drafter, no connector."""
    llm = patchbay.LLM(load_settings(None, overrides=[f"model.path={tiny_llama}", "cache.num_blocks=256"]))
    return [o.text for o in llm.generate(PROMPTS, sampling(llm.tokenizer))]


def sampling(tokenizer) -> SamplingParams:
    return SamplingParams(
        max_tokens=24, ignore_eos=True, allowed_token_ids=tokenizer.encode(ALLOWED_WORDS, add_special_tokens=False)
    )


def test_served_outputs_with_ngram_and_shared_storage_are_the_plain_offline_ones(tiny_llama, storage, reference):
    # Offline first with the same plugins: the connector saves every prompt's full blocks to the storage.
    offline = patchbay.LLM(plugin_settings(tiny_llama, storage))
    params = sampling(offline.tokenizer)
    assert [o.text for o in offline.generate(PROMPTS, params)] == reference
    del offline
    with running_server(plugin_settings(tiny_llama, storage)) as server:

        async def scenario() -> list[str]:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

            async def one(prompt: str) -> str:
                text = ""
                async for chunk in await client.completions.create(
                    model=tiny_llama.name,
                    prompt=prompt,
                    max_tokens=24,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True, "allowed_token_ids": params.allowed_token_ids},
                ):
                    text += chunk.choices[0].text
                return text

            texts = await asyncio.gather(*(one(prompt) for prompt in PROMPTS))
            await client.close()
            return list(texts)

        assert asyncio.run(scenario()) == reference
        metrics = server.wait_until_idle(timeout=15)
    # The server's fresh engine loaded the prompts' blocks from the storage and its drafts were verified.
    assert metrics["patchbay_kv_connector_loaded_tokens_total"] > 0
    assert metrics["patchbay_spec_decode_num_draft_tokens_total"] > 0
    assert metrics["patchbay_spec_decode_num_accepted_tokens_total"] > 0
